"""A round repeated on a daemon thread: the dispatch leases (``controlplane.serving.owners``),
the serving feed of a loops process (``controlplane.loops.remote_serving``), the leader lease
(``controlplane.loops.leadership``) and a kept advisory lock (``controlplane.db.lease``) each
run one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Repeating"]

logger = logging.getLogger(__name__)


class Repeating:
    """``action`` every ``every_s`` on a daemon thread named ``name``, from :meth:`start` until
    :meth:`stop`. A round that raises is logged (as ``what``) and the next one runs: what the
    rounds keep up (a lease, a lock, a feed) must outlive a bad one."""

    def __init__(self, action: Callable[[], object], every_s: float, name: str, what: str) -> None:
        self.action = action
        self.every_s = float(every_s)
        self.name = name
        self.what = what
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """The first round waits ``every_s`` (a caller that wants one now runs it first)."""
        if self._thread is not None:
            raise RuntimeError(f"{self.what} is already running")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more rounds; a running one is waited for."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.every_s):
            try:
                self.action()
            except Exception:
                logger.exception("%s: a round failed", self.what)
