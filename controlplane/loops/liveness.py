"""Liveness of running workers: which ones have stopped answering and should be replaced.

A worker the provider calls ``running`` can still be of no use: its process hung (stopped, a
deadlock, a machine out of memory that swaps), its agent crashed while the machine runs on. The
serving path takes such a worker out of matching at its first transport failure
(:mod:`controlplane.serving.health`), but the machine stays paid for until something ends it.
The reconciler does: each tick it hands the running workers to :class:`Liveness`, which asks
each one ``GET /health`` (:func:`http_probe`) in the background, and a worker found
*unresponsive* is terminated (cause ``unresponsive``) and replaced by rule 5 in the same tick
(docs/provisioners.md, "Workers that stop answering").

A worker is unresponsive when its last :data:`MIN_FAILED_PROBES` probes or more, spanning
``after_s`` (60 s by default: twelve ticks, so that a worker slow past one probe's timeout on a
busy machine, or a network blip, is not taken for dead), went unanswered, and it is no longer
booting: it has answered before, or it was launched ``never_after_s`` ago (the straggler
timeout, 600 s: EC2's ``running`` says nothing of the agent, and a worker still downloading its
model is not dead). The launch time is the provider's, so a control plane that restarts or a
new leader replaces a worker hung since before it in ``after_s``, not in ``never_after_s``.
A run of failures starts afresh after a gap of more than ``after_s`` (and 30 s) between two
probes of the worker (a replica that was not the leader, a provider that could not be
listed): nobody asked meanwhile, so the silence is not known to have lasted.

An answer is a JSON object whose ``status`` is ``ok`` or ``stopping`` (the agent serves, or is
finishing what it has). ``loading`` is an agent up whose models are not loaded yet: no answer,
which the boot allowance above covers; ``failed`` (its models could not be loaded) is none.

An answer whose ``busy_s`` (how long the agent's oldest batch has run, with ``busy`` true) is
over ``stuck_after_s`` (:data:`DEFAULT_STUCK_AFTER_S`, 600 s), and over its caller's timeout where
the agent says it (``busy_timeout_s``: a batch its caller still waits for is not stuck), is a
worker whose model is stuck on a query: the serving path keeps it out of matching while it says
it is busy, so it serves nothing; it is a verdict at its first probe, like the next.

An answer whose ``protocol`` is older than
:data:`~provisioners.worker.oip.WORKER_PROTOCOL` is a worker that cannot serve this control plane
(an older release's, adopted across an upgrade: every batch sent to it fails): it is a verdict at
its first probe, whatever the others do. An answer without one (the agents before the field) is
an answer.

When more than half of the workers probed, and at least two, are silent at once, the likelier
cause is the control plane's side (its network, a starved machine), and replacing them all would
turn a blip into an outage: no worker is found unresponsive then (a warning says so) until the
share falls again.

Probes run in the background, at most :data:`MAX_PARALLEL_PROBES` at a time, each with its own
timeout: a tick never waits for them (a budget drain in the same tick is not held up), and the
verdicts of a tick rest on the probes finished by then (one round behind: a tick's period). A
round still in flight when the next tick comes (a probe held up) is waited for, not doubled.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from controlplane.serving.transport import busy_of
from provisioners.base import ProvisionedInstance, with_port
from provisioners.worker.oip import WORKER_PROTOCOL

logger = logging.getLogger(__name__)

DEFAULT_AFTER_S = 60.0
# An agent that says its oldest batch has run this long is stuck on it (its model hangs on a
# query while its HTTP server answers): the serving path keeps such a worker out of matching
# while it says it is busy, so it would stay paid for and serve nothing (docs/provisioners.md,
# "Workers that stop answering"). Ten minutes: far past any batch's call timeout.
DEFAULT_STUCK_AFTER_S = 600.0
# The longest caller's timeout the probe waits out (the agent's ``busy_timeout_s``): the
# dispatcher's own calls time out in seconds to minutes, but a direct caller of an agent may
# send any timeout, and 10^12 us would have kept a stuck worker for 11 days.
MAX_CALLER_WAIT_S = 3600.0
DEFAULT_PROBE_TIMEOUT_S = 2.0
MAX_PARALLEL_PROBES = 16
# At least this many unanswered probes in a row, whatever after_s (a setting below the
# reconciler's period would otherwise make one missed probe a death).
MIN_FAILED_PROBES = 3
# Probes of a worker further apart than this (or than after_s, if longer) start its run of
# failures afresh: nobody asked in between.
MIN_GAP_S = 30.0
# More than this share of the probed workers silent at once (and at least two): the control
# plane's side is the likelier cause, and nothing is replaced.
MASS_SILENCE_SHARE = 0.5
# The most of an answer read: /health is a few hundred bytes.
_MAX_ANSWER_BYTES = 64 * 1024

# A probe's answer: True, the worker answered; False, it did not; a text, it answered but cannot
# serve this control plane (why: an agent of an older release, whose protocol it does not read).
Probe = Callable[[ProvisionedInstance], bool | str]


def http_probe(
    port: int,
    timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
) -> Probe:
    """A probe asking a worker's agent ``GET /health`` at its address (``port`` where the address
    names none: an EC2 private IP), straight (no proxy), within ``timeout_s`` a socket operation;
    whether it answered (module docstring: ``status`` ``ok`` or ``stopping``, whatever the HTTP
    status), or why it cannot serve and is to be replaced: an agent whose ``protocol`` is older
    than :data:`~provisioners.worker.oip.WORKER_PROTOCOL` (an agent that says none answered), or
    one whose oldest batch has run for over ``stuck_after_s`` and over its caller's timeout
    where the agent says it (its ``busy_s`` and ``busy_timeout_s``: a model stuck on a query)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe(instance: ProvisionedInstance) -> bool | str:
        if not instance.address:
            return False
        url = f"http://{with_port(instance.address, port)}/health"
        try:
            with opener.open(url, timeout=timeout_s) as response:
                raw = response.read(_MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as error:  # 503 while stopping: an answer
            try:
                raw = error.read(_MAX_ANSWER_BYTES)
            except OSError:
                return False
        except (OSError, ValueError):  # refused, timed out, reset, a bad address
            return False
        try:
            body = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(body, dict) or body.get("status") not in ("ok", "stopping"):
            return False
        busy = busy_of(body)  # as the dispatcher reads the agent's ready answer
        # Stuck: past the limit, and past what its caller waits for it, where the agent says
        # (a batch whose caller still waits is not stuck, whatever the limit: a limit under a
        # call's timeout ended a slow query's worker mid-call, and the query, tried again,
        # took out the next).
        waited_s = min(busy.timeout_s or 0.0, MAX_CALLER_WAIT_S) if busy is not None else 0.0
        if busy is not None and busy.busy_s > max(stuck_after_s, waited_s):
            # Tenths, rounded up: whole seconds read "600 s, over 600 s" at 600.4 s.
            ran_s = math.ceil(busy.busy_s * 10.0) / 10.0
            if waited_s <= stuck_after_s:
                limit = f"{stuck_after_s:g} s"
            elif waited_s < MAX_CALLER_WAIT_S:
                limit = f"its caller's timeout of {waited_s:g} s"
            else:
                limit = f"{waited_s:g} s, the longest caller's timeout waited out"
            return (
                f"its agent has run one batch for {ran_s:.1f} s, over {limit}:"
                " its model is stuck on it; replaced"
            )
        # No field, or not a whole number: unknown (the agents of 2026-11-29 to 2026-12-06
        # read binary tensors and say no protocol), never a reason to replace a worker.
        protocol = body.get("protocol")
        if type(protocol) is not int or protocol >= WORKER_PROTOCOL:
            return True
        return (
            f"its agent reads worker protocol {protocol}, this control plane sends"
            f" {WORKER_PROTOCOL}: an older release's worker, which cannot serve its batches;"
            " replaced by one of this release"
        )

    return probe


@dataclass
class _Seen:
    # Its boot's start (epoch seconds): the provider's launch time, else when this process
    # first saw it running (``launched``: which of the two).
    since_s: float
    launched: bool
    probed_s: float | None = None  # its last finished probe
    answered: bool = False  # it answered once (in this process)
    failures: int = 0  # unanswered probes in a row
    silent_since_s: float | None = None  # the first of them
    cannot_serve: str | None = None  # it answers, but cannot serve: why (its last probe's)


class Liveness:
    """Which running workers have stopped answering (module docstring). ``probe`` asks one
    worker; ``after_s`` and ``never_after_s`` are the two limits. With ``background`` (the
    reconciler's) the probes of a tick run in threads of their own and count from the next tick
    on; without, :meth:`check` probes and waits (tests, tools)."""

    def __init__(
        self,
        probe: Probe,
        *,
        after_s: float = DEFAULT_AFTER_S,
        never_after_s: float,
        background: bool = True,
    ) -> None:
        if not after_s > 0 or not never_after_s > 0:
            raise ValueError(
                f"after_s and never_after_s must be > 0, got {after_s!r} and {never_after_s!r}"
            )
        self.probe = probe
        self.after_s = after_s
        self.never_after_s = max(never_after_s, after_s)
        self.gap_s = max(after_s, MIN_GAP_S)
        self.background = background
        self._seen: dict[str, _Seen] = {}
        self._round: _Round | None = None
        self._held = False  # a mass silence is holding the verdicts back (warned once)

    def check(self, instances: Iterable[ProvisionedInstance], now: datetime) -> dict[str, str]:
        """The unresponsive ones among ``instances`` the provider calls running: provider id ->
        why. Starts their next probes (module docstring); instances no longer listed running
        are forgotten (a worker seen again starts afresh)."""
        now_s = now.timestamp()
        running = {i.provider_id: i for i in instances if i.state == "running"}
        for gone in self._seen.keys() - running.keys():
            del self._seen[gone]
        for pid, instance in running.items():
            if pid not in self._seen:
                launched = instance.launched_at
                since_s = now_s if launched is None else launched.timestamp()
                self._seen[pid] = _Seen(since_s, launched is not None)
        if self.background:
            if self._round is not None and self._round.done():
                self._fold(self._round.started_s, self._round.answers)
                self._round = None
            if self._round is None and running:
                self._round = _Round(self.probe, list(running.values()), now_s)
        elif running:
            self._fold(now_s, _Round(self.probe, list(running.values()), now_s).wait())
        return self._verdicts(now_s)

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait for the probes in flight (tests); whether none is left."""
        return self._round is None or self._round.wait_done(timeout_s)

    def _fold(self, at_s: float, answers: Mapping[str, bool | str]) -> None:
        for pid, answered in answers.items():
            seen = self._seen.get(pid)
            if seen is None:  # no longer running
                continue
            if seen.probed_s is not None and at_s - seen.probed_s > self.gap_s:
                seen.failures, seen.silent_since_s = 0, None  # nobody asked meanwhile
            seen.probed_s = at_s
            seen.cannot_serve = answered if isinstance(answered, str) else None
            if answered:
                seen.answered = True
                seen.failures, seen.silent_since_s = 0, None
            else:
                seen.failures += 1
                if seen.silent_since_s is None:
                    seen.silent_since_s = at_s

    def _booting(self, seen: _Seen, now_s: float) -> bool:
        """Whether ``seen`` may still be booting: never answered, launched (or, the launch
        time unknown, first seen) less than ``never_after_s`` ago."""
        return not seen.answered and now_s - seen.since_s < self.never_after_s

    def _verdicts(self, now_s: float) -> dict[str, str]:
        # A worker that answers but cannot serve (an older release's, or one stuck on a batch) is
        # replaced at once: nothing sent to it is served, whatever the others do.
        found = {
            pid: why for pid, seen in self._seen.items() if (why := seen.cannot_serve) is not None
        }
        # The share is of the workers past their boot: new ones are silent as a rule.
        probed = [
            seen
            for seen in self._seen.values()
            if seen.probed_s is not None and not self._booting(seen, now_s)
        ]
        silent = [seen for seen in probed if seen.failures > 0]
        if len(silent) >= 2 and len(silent) > MASS_SILENCE_SHARE * len(probed):
            if not self._held:
                logger.warning(
                    "liveness: %d of %d running workers do not answer /health at once; none is"
                    " replaced while more than half are silent (the control plane's network or"
                    " machine is the likelier cause)",
                    len(silent),
                    len(probed),
                )
                self._held = True
            return found
        self._held = False
        for pid, seen in self._seen.items():
            if pid in found:
                continue
            why = self._verdict(seen, now_s)
            if why is not None:
                found[pid] = why
        return found

    def _verdict(self, seen: _Seen, now_s: float) -> str | None:
        if seen.failures < MIN_FAILED_PROBES or seen.silent_since_s is None:
            return None
        silent_s = now_s - seen.silent_since_s
        if silent_s < self.after_s:
            return None
        if self._booting(seen, now_s):
            return None  # as far as anyone can tell
        said = f"its worker has not answered /health for {silent_s:.0f} s ({seen.failures} probes)"
        if seen.answered or not seen.launched:
            return said
        return f"{said}, nor once since its launch {now_s - seen.since_s:.0f} s ago"

    def silent(self) -> set[str]:
        """The workers whose last probe went unanswered (rule 5 ends them first when the fleet
        shrinks)."""
        return {pid for pid, seen in self._seen.items() if seen.failures > 0}


class _Round:
    """One round of probes: up to :data:`MAX_PARALLEL_PROBES` daemon threads, each asking its
    share of the workers in turn (a probe that hangs past its timeout holds no tick up, and no
    thread outlives the interpreter)."""

    def __init__(self, probe: Probe, instances: list[ProvisionedInstance], started_s: float):
        self.started_s = started_s
        self.answers: dict[str, bool | str] = {}
        self._lock = threading.Lock()
        count = min(MAX_PARALLEL_PROBES, len(instances))
        self._threads = [
            threading.Thread(
                target=self._ask,
                args=(probe, instances[i::count]),
                name="liveness-probe",
                daemon=True,
            )
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _ask(self, probe: Probe, instances: list[ProvisionedInstance]) -> None:
        for instance in instances:
            answered: bool | str
            try:
                answered = probe(instance)
            except Exception:  # a probe is I/O: any failure is no answer
                logger.debug("liveness probe of %s failed", instance.provider_id, exc_info=True)
                answered = False
            with self._lock:
                self.answers[instance.provider_id] = answered

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def wait_done(self, timeout_s: float | None) -> bool:
        for thread in self._threads:
            thread.join(timeout_s)
        return self.done()

    def wait(self) -> dict[str, bool | str]:
        self.wait_done(None)
        return self.answers
