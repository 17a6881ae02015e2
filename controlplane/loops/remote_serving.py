"""The serving loop as a loops process running apart sees it: over the serving process's
internal routes (:mod:`controlplane.api.routes.internal`; docs/service.md, "Serving apart from the
loops").

:class:`RemoteServing` stands in for :class:`~controlplane.serving.loop.ServingLoop` where the
loops read it (:class:`ServingView`: the observed arrivals, the statuses, the batch and API times,
the windows). A thread (:meth:`RemoteServing.start`) exchanges the feed every ``pull_s``: it sends
the gears in force (the switcher's, :meth:`~controlplane.loops.live_gears.LiveGears.in_force`),
the tuner's batch caps (:meth:`~controlplane.loops.live_tuner.LiveTuner.batch_caps`) and the apps
recalibrated since, and keeps the arrivals (on the serving process's clock, moved
onto this one's by the offset between the two clocks at the last exchange) and statuses it gets
back. The calibration's batch and API times and the roll-up's windows are read when asked.

A serving process that does not answer is logged at once and every minute of the outage, and
the loops process's ``/healthz`` says so (``serving_feed``: "down", with how long); meanwhile no
app reads as served (the tuner leaves apps on their plans, the gears and the INFaaS scaler see
no status), no batch time is observed and no window is rolled up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import httpx
import numpy as np
from numpy.typing import NDArray

from controlplane.clock import Clock
from controlplane.policies.rollout import VersionFigures
from controlplane.repeating import Repeating
from controlplane.serving.dispatcher import AppStatus
from controlplane.serving.observations import ARRIVALS_KEPT, WindowSummary
from controlplane.serving.versions import VersionSource
from controlplane.serving.wire import status_from_json, window_from_json

__all__ = ["DEFAULT_PULL_S", "RemoteServing", "ServingObservations", "ServingView"]

logger = logging.getLogger(__name__)

DEFAULT_PULL_S = 0.1
_TIMEOUT_S = 5.0
# How often a feed that keeps failing is said again in the log, s.
DOWN_REMIND_S = 60.0


class ServingObservations(Protocol):
    """What the calibration reads of the serving loop's observations."""

    def batch_times_ms(self, app: str) -> dict[tuple[str, str], dict[int, list[float]]]: ...
    def api_times_ms(self, app: str) -> list[float]: ...
    def serving_cpu_ms(self, app: str, now_s: float) -> float | None: ...
    def forget_batch_times(self, app: str, model: str, instance_type: str) -> None: ...
    def forget_api_times(self, app: str) -> None: ...
    def holding(self) -> AbstractContextManager[None]: ...


class ServingView(Protocol):
    """What the loops read of the serving loop (the loop itself, or :class:`RemoteServing`)."""

    @property
    def observations(self) -> ServingObservations: ...

    @property
    def versions(self) -> VersionSource: ...

    def observed_arrivals(self, app: str) -> NDArray[np.float64] | None: ...
    def statuses(self) -> list[AppStatus]: ...
    def take_window(self, app: str) -> WindowSummary | None: ...


class _RemoteObservations:
    def __init__(self, remote: RemoteServing) -> None:
        self._remote = remote
        # Inside holding(), per thread: each app's observations document as read once (the
        # loops run on a thread pool; another job's reads are not the pass's).
        self._local = threading.local()

    @property
    def _held(self) -> dict[str, Any] | None:
        held: dict[str, Any] | None = getattr(self._local, "held", None)
        return held

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Read each app's observations document at most once inside the block (on the thread
        that entered it): a calibration pass reads an app's batch times, its API times and its
        CPU figure, three reads of one document that the serving process would otherwise write
        three times a tick."""
        self._local.held = {}
        try:
            yield
        finally:
            self._local.held = None

    def _document(self, app: str) -> Any:
        held = self._held
        if held is not None and app in held:
            return held[app]
        found = self._remote.call("GET", f"/apps/{app}/observations")
        if held is not None:
            held[app] = found
        return found

    def batch_times_ms(self, app: str) -> dict[tuple[str, str], dict[int, list[float]]]:
        found = self._document(app)
        if found is None:
            return {}
        return {
            (model, instance_type): {int(size): list(times) for size, times in by_size.items()}
            for model, instance_type, by_size in found["batch_times_ms"]
        }

    def api_times_ms(self, app: str) -> list[float]:
        found = self._document(app)
        return [] if found is None else [float(t) for t in found["api_times_ms"]]

    def serving_cpu_ms(self, app: str, now_s: float) -> float | None:
        # The serving process reads its CPU on its own clock: now_s is the loops'.
        found = self._document(app)
        value = None if found is None else found.get("serving_cpu_ms")
        return None if value is None else float(value)

    def forget_batch_times(self, app: str, model: str, instance_type: str) -> None:
        if self._held is not None:
            self._held.pop(app, None)  # the document held has those times still
        self._remote.call(
            "POST",
            f"/apps/{app}/forget-batch-times",
            {"model": model, "instance_type": instance_type},
        )

    def forget_api_times(self, app: str) -> None:
        if self._held is not None:
            self._held.pop(app, None)  # the document held has those times still
        self._remote.call("POST", f"/apps/{app}/forget-api-times", optional=True)


class _RemoteVersions:
    def __init__(self, remote: RemoteServing) -> None:
        self._remote = remote

    def figures(self, app: str, rollout_id: int, step_index: int) -> dict[str, VersionFigures]:
        found = self._remote.call(
            "GET", f"/apps/{app}/versions?rollout_id={rollout_id}&step_index={step_index}"
        )
        if found is None:
            return {}
        # The document also holds the derived shares (to_json's): only the fields are read.
        names = [field.name for field in dataclasses.fields(VersionFigures)]
        return {v: VersionFigures(**{k: f[k] for k in names}) for v, f in found.items()}

    def forget(self, app: str) -> None:
        self._remote.call("POST", f"/apps/{app}/versions/forget")


def _failure(error: httpx.HTTPError) -> str:
    """A failed call in one line: an answer's status and the serving process's own reason
    (``HTTP 401 Unauthorized: unknown or revoked API token``), else the transport's error.
    httpx's text for a status was two lines, the second a link to MDN, and left the reason out."""
    if isinstance(error, httpx.HTTPStatusError):
        answer = error.response
        said = f"HTTP {answer.status_code} {answer.reason_phrase}".rstrip()
        try:
            reason = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = None
        return f"{said}: {' '.join(reason.split())}" if isinstance(reason, str) else said
    return " ".join(str(error).split()) or type(error).__name__


class RemoteServing:
    """The serving process at ``url`` (its base URL), read with the admin token ``token``
    (thread-safe; see the module docstring). ``client``: the HTTP client to send with (a test's
    client of an app in process; default a new one), closed by :meth:`close`."""

    def __init__(
        self,
        url: str,
        token: str,
        clock: Clock,
        *,
        pull_s: float = DEFAULT_PULL_S,
        client: httpx.Client | None = None,
    ) -> None:
        if not pull_s > 0:
            raise ValueError(f"pull_s must be > 0, got {pull_s!r}")
        self.url = url.rstrip("/")
        self.clock = clock
        self.pull_s = float(pull_s)
        self.gears: Callable[[], Mapping[str, tuple[int, int]]] = dict
        # The tuner's batch caps of single-model apps (LiveTuner.batch_caps), sent with the gears.
        self.batch_caps: Callable[[], Mapping[str, Mapping[str, int]]] = dict
        # Whether the gears and batch caps are known yet (the switcher has read the store once,
        # after the tuner: LiveGears.refreshed); until then the feed leaves them out, and the
        # serving process keeps those it serves (a restarted loops process sent none at its
        # first exchanges, and the serving process served every app by its spec for a second
        # or two).
        self.gears_known: Callable[[], bool] = lambda: True
        self._client = client if client is not None else httpx.Client(timeout=_TIMEOUT_S)
        self._base = f"{self.url}/internal/v1"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._observations = _RemoteObservations(self)
        self._versions = _RemoteVersions(self)
        self._lock = threading.Lock()
        self._arrivals: dict[str, NDArray[np.float64]] = {}  # on the serving process's clock
        self._served: set[str] = set()
        self._statuses: list[AppStatus] = []
        self._offset_s = 0.0  # this clock minus the serving process's
        self._recalibrated: set[str] = set()
        self._down = False
        self._down_since = self._down_said = 0.0  # monotonic: since when, and when last said
        # The loops process is stopping (stopping()): the serving process, stopped by the same
        # signal, closes its port first, and a feed refused then is no outage.
        self._stopping = False
        self._rounds = Repeating(self.pull, self.pull_s, "serving-feed", "serving feed")

    @property
    def observations(self) -> ServingObservations:
        return self._observations

    @property
    def versions(self) -> VersionSource:
        """The rollouts' figures per version (the rollout loop's meter), read when asked."""
        return self._versions

    # --- the exchange -------------------------------------------------------------------------

    def start(self) -> None:
        """Exchange the feed now, then every ``pull_s`` on a daemon thread until :meth:`close`."""
        if self._rounds.running:
            raise RuntimeError("the serving feed is already running")
        self.pull()
        self._rounds.start()

    def close(self) -> None:
        self._rounds.stop()
        self._client.close()

    def stopping(self) -> None:
        """The loops process stops: a feed that fails from now on is not logged as an outage
        (every clean stop warned that the serving process did not answer)."""
        self._stopping = True

    def down_for_s(self) -> float | None:
        """How long the feed has failed, s (None while the serving process answers): the
        loops process's ``/healthz`` says it (``serving_feed``), so that a loops process that
        leads blind shows it where a supervisor looks, not only in its log."""
        if not self._down:
            return None
        return max(0.0, time.monotonic() - self._down_since)

    def recalibrated(self, app: str) -> None:
        """Have the serving process's resolver forget ``app`` at the next exchange."""
        with self._lock:
            self._recalibrated.add(app)

    def pull(self) -> bool:
        """One exchange of the feed; whether the serving process answered."""
        with self._lock:
            since = {app: float(a[-1]) for app, a in self._arrivals.items() if a.size}
            recalibrated, self._recalibrated = self._recalibrated, set()
        body: dict[str, Any] = {"since_s": since, "recalibrated": sorted(recalibrated)}
        if self.gears_known():
            body["gears"] = {app: list(pair) for app, pair in self.gears().items()}
            body["batch_caps"] = {app: dict(caps) for app, caps in self.batch_caps().items()}
        found = self.call("POST", "/feed", body)
        if found is None:
            with self._lock:
                self._recalibrated |= recalibrated
                self._served = set()
                self._statuses = []
            return False
        offset = self.clock.now_s() - float(found["now_s"])
        apps: dict[str, Any] = found["apps"]
        statuses = [
            status_from_json(entry["status"])
            for _app, entry in sorted(apps.items())
            if entry["status"] is not None
        ]
        with self._lock:
            for app, entry in apps.items():
                new = np.asarray(entry["arrivals_s"], dtype=np.float64)
                kept = self._arrivals.get(app)
                joined = new if kept is None else np.concatenate((kept, new))
                self._arrivals[app] = joined[-ARRIVALS_KEPT:]
            for gone in set(self._arrivals) - set(apps):
                del self._arrivals[gone]
            self._served = set(apps)
            self._statuses = statuses
            self._offset_s = offset
        return True

    def call(self, method: str, path: str, body: object = None, *, optional: bool = False) -> Any:
        """One call of an internal route: its JSON answer, or None when the serving process did
        not answer it (logged once per outage). ``optional``: a route an older serving process
        may not have, whose 404 is no outage (a loops process upgraded before it)."""
        try:
            answer = self._client.request(
                method, f"{self._base}{path}", json=body, headers=self._headers
            )
            if optional and answer.status_code == 404:
                return None
            answer.raise_for_status()
        except httpx.HTTPError as error:
            self._said_down(error)
            return None
        if self._down:
            self._down = False
            logger.info("the serving process at %s answers again", self.url)
        return None if answer.status_code == 204 else answer.json()

    def _said_down(self, error: httpx.HTTPError) -> None:
        """Log a feed that fails: at once, then again every :data:`DOWN_REMIND_S` while it does
        (a loops process that leads blind, its tuner, gears and calibration seeing no traffic,
        said so once and never again). A refusal (a 4xx: the internal token, the URL) is an
        error: it does not pass by itself."""
        now = time.monotonic()
        if self._stopping:
            logger.debug("the serving process at %s: %s (stopping)", self.url, _failure(error))
            return
        if self._down and now - self._down_said < DOWN_REMIND_S:
            return
        refused = isinstance(error, httpx.HTTPStatusError) and error.response.status_code < 500
        since = (
            f" (for {now - self._down_since:.0f} s: the tuner, the gears and the calibration see"
            " no traffic)"
            if self._down
            else ""
        )
        if not self._down:
            self._down_since = now
        self._down, self._down_said = True, now
        if refused:
            logger.error(
                "the serving process at %s refuses the feed: %s%s (check serving_url and"
                " internal_token)",
                self.url,
                _failure(error),
                since,
            )
        else:
            logger.warning(
                "the serving process at %s does not answer: %s%s", self.url, _failure(error), since
            )

    # --- what the loops read ------------------------------------------------------------------

    def serves(self, app: str) -> bool:
        with self._lock:
            return app in self._served

    def observed_arrivals(self, app: str) -> NDArray[np.float64] | None:
        """The app's arrivals on this process's clock, oldest first; None when the serving
        process does not serve it (or did not answer the last exchange)."""
        with self._lock:
            if app not in self._served:
                return None
            kept = self._arrivals.get(app)
            offset = self._offset_s
        return np.empty(0, dtype=np.float64) if kept is None else kept + offset

    def statuses(self) -> list[AppStatus]:
        with self._lock:
            return list(self._statuses)

    def take_window(self, app: str) -> WindowSummary | None:
        found = self.call("POST", f"/apps/{app}/window")
        return None if found is None else window_from_json(found)
