"""Shedding at the front door: the share of an app's queries refused before they cost the API.

Admission control (:mod:`controlplane.serving.admission`) refuses a query whose queue cannot
be served within the SLO, and that refusal is right; but on a serving process whose own CPU is
the bottleneck (a model of a millisecond, two cores shared with the workers) a refusal that
has gone through the HTTP server's request cycle, the ASGI app, the token check and admission
costs about half of what an answer does. Past saturation most queries are refused, so their
refusals took the CPU the answers needed: at twice the serving process's capacity the answered
rate fell to a fifth to a half of that capacity (docs/serving.md, "Overload at the front").

:class:`FrontThrottle` decides, as the HTTP protocol parses a request's head, whether an
inference query is refused there, with a 429 written straight to the socket (no request
cycle, no task, no app): Google's adaptive throttling ("Handling Overload", *Site Reliability
Engineering*, 2016), moved from the client to the server's front. Per app it keeps, decayed
over :data:`WINDOW_S`, the queries that reached the front (``requests``: those it refused, and
those it let through once admission's verdict on them is known, so that queries still in
flight, counted at the front but not yet admitted, do not read as refused: the answers lag the
arrivals by their latency, and at a mild overload that lag alone had the front refuse a few
percent more than admission did without it) and those admission admitted (``accepts``), and
refuses a new one with probability

    max(0, (requests - K x accepts) / (requests + 1))

where ``K`` is :data:`K`. At a steady overload where admission admits ``C`` a second of ``R``,
the front lets through ``K x C`` a second and admission refuses the other ``(K - 1) x C``: the
admission stays the judge (it still refuses, so it keeps seeing the queue), and most of the
refusals are the cheap ones. Once the load falls under capacity admission refuses nothing, and
the share falls to zero geometrically (at each window by a factor ``K``'s excess). The front
refuses only for an app whose admission refused a query within the window (``armed``): an
app that is not overloaded, or one the front has never seen answered, is never refused here.

Pure: a clock and a random source are given; the serving loop records the front's refusals as
admission's (arrivals and misses: the tuner must see the whole demand), and the API's protocol
writes them (:mod:`controlplane.service.protocol`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

__all__ = ["MAX_APPS", "WINDOW_S", "FrontThrottle", "K"]

# Queries let through per query admission admits, past saturation: 1.25 leaves admission a
# fifth of the refusals (its verdicts keep the queue's state current) and the front the rest.
K = 1.25
# The counts' decay time, s: an overload that sets in is followed within about a second.
WINDOW_S = 1.0
# Admission refusals (decayed) within the window that arm the front for an app.
ARMED = 0.5
# Apps tracked at most (each one the front has seen answered); past it the oldest is dropped.
MAX_APPS = 1000


class _Counts:
    __slots__ = ("accepts", "at_s", "refusals", "requests")

    def __init__(self, now_s: float) -> None:
        self.requests = 0.0
        self.accepts = 0.0
        self.refusals = 0.0
        self.at_s = now_s

    def decay(self, now_s: float, window_s: float) -> None:
        elapsed = now_s - self.at_s
        if elapsed > 0:
            factor = math.exp(-elapsed / window_s)
            self.requests *= factor
            self.accepts *= factor
            self.refusals *= factor
            self.at_s = now_s


class FrontThrottle:
    """Per app, whether the front refuses a query now (module docstring)."""

    def __init__(
        self,
        clock_s: Callable[[], float],
        *,
        k: float = K,
        window_s: float = WINDOW_S,
        rng: random.Random | None = None,
    ) -> None:
        if not (k >= 1.0 and math.isfinite(k)):
            raise ValueError(f"k must be >= 1, got {k!r}")
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.clock_s = clock_s
        self.k = k
        self.window_s = window_s
        self.rng = rng if rng is not None else random.Random()
        self._apps: dict[str, _Counts] = {}

    def share(self, app: str) -> float:
        """The probability that a query of ``app`` arriving now is refused at the front."""
        counts = self._apps.get(app)
        if counts is None:
            return 0.0
        counts.decay(self.clock_s(), self.window_s)
        return self._share(counts)

    def _share(self, counts: _Counts) -> float:
        if counts.refusals < ARMED:
            return 0.0
        return max(0.0, (counts.requests - self.k * counts.accepts) / (counts.requests + 1.0))

    def refuse(self, app: str) -> bool:
        """Whether the front refuses a query of ``app`` arriving now (never for an app it has
        not seen answered). A refused query is counted here; one let through is counted once
        admission's verdict on it is known (:meth:`answered`), so that the queries still in
        flight do not read as refused."""
        share = self.share(app)
        if share > 0.0 and self.rng.random() < share:
            self._apps[app].requests += 1.0
            return True
        return False

    def answered(self, app: str, admitted: bool) -> None:
        """Admission's verdict on a query of ``app`` the front let through: admitted (whatever
        its answer then was) or refused (429)."""
        now = self.clock_s()
        counts = self._apps.get(app)
        if counts is None:
            if len(self._apps) >= MAX_APPS:
                del self._apps[next(iter(self._apps))]
            counts = self._apps[app] = _Counts(now)
        else:
            counts.decay(now, self.window_s)
        counts.requests += 1.0
        if admitted:
            counts.accepts += 1.0
        else:
            counts.refusals += 1.0
