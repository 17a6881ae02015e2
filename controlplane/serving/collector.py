"""The serving process and Python's cyclic garbage collector: what survives a full collection is
frozen out of the next ones' reach.

A full (generation 2) collection walks every object the collector tracks and has not frozen. The
serving loop freezes what is alive when it starts (the imported libraries, the app, the
settings), but more arrives after: the modules the first plan or query imports, each app's
dispatcher, configuration and resolved profiles, the observations' windows. At 2,000 queries
per second on `/v2` (`python -m benchmarks.serving_speed api --protocols v2`, each collection
timed by a ``gc.callbacks`` hook in the serving process: a diagnostic, not kept), 65,000 to
72,000 such objects were walked by each full collection, a pause of 10 to 40 ms every few
seconds in which the event loop answered nothing.

:class:`FullCollections` watches the collector (``gc.callbacks``) and, at the serving loop's next
refresh after a full collection, freezes what is alive (``gc.freeze``): mostly what survived
that collection, which has lived through every generation and so is long-lived, and the queries
in flight at that moment; the next full collection walks only what arrived since. The price: a
reference cycle among frozen objects that later becomes garbage is not reclaimed while frozen
(objects without cycles, a query's among them, are freed by their reference counts as ever). Every
``thaw_s`` (an hour by default) the whole heap is collected once (``gc.unfreeze``, a full
collection, ``gc.freeze``): one pause of the old kind an hour reclaims such cycles.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["DEFAULT_THAW_S", "Collector", "FullCollections"]

DEFAULT_THAW_S = 3600.0


class Collector(Protocol):
    """What :class:`FullCollections` uses of the :mod:`gc` module."""

    callbacks: list[Callable[[str, dict[str, Any]], None]]

    def freeze(self) -> None: ...
    def unfreeze(self) -> None: ...
    def collect(self, generation: int = 2) -> int: ...


class FullCollections:
    """Freezes what is alive after each full collection at the next :meth:`step` (module
    docstring); every ``thaw_s`` on ``clock_s``, collects the whole heap once."""

    def __init__(
        self,
        thaw_s: float = DEFAULT_THAW_S,
        clock_s: Callable[[], float] = time.monotonic,
        collector: Collector = gc,  # type: ignore[assignment]
    ) -> None:
        if not thaw_s > 0:
            raise ValueError(f"thaw_s must be > 0, got {thaw_s!r}")
        self._thaw_s = thaw_s
        self._clock_s = clock_s
        self._gc = collector
        self._full = False
        self._installed = False
        self._thawed_s = clock_s()
        self.frozen = 0  # freezes after a full collection so far
        self.thawed = 0  # whole-heap collections so far

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector, inside the collection: note it, act outside.
        if phase == "stop" and info.get("generation") == 2:
            self._full = True

    def install(self) -> None:
        """Start watching the collector (idempotent)."""
        if not self._installed:
            self._gc.callbacks.append(self._seen)
            self._installed = True
            self._thawed_s = self._clock_s()

    def uninstall(self) -> None:
        """Stop watching the collector (idempotent)."""
        if self._installed:
            self._gc.callbacks.remove(self._seen)
            self._installed = False
            self._full = False

    def step(self) -> None:
        """Freeze what the last full collection left, if one ran since the last step; collect
        the whole heap once every ``thaw_s``."""
        if self._clock_s() - self._thawed_s >= self._thaw_s:
            self._gc.unfreeze()
            self._gc.collect()
            self._gc.freeze()
            self._thawed_s = self._clock_s()
            self._full = False
            self.thawed += 1
        elif self._full:
            self._full = False
            self._gc.freeze()
            self.frozen += 1
