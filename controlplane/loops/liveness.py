"""Liveness of running workers: which ones have stopped answering and should be replaced.

A worker the provider calls ``running`` can still be of no use: its process hung (stopped, a
deadlock, a machine out of memory that swaps), its agent crashed while the machine runs on. The
serving path takes such a worker out of matching at its first transport failure
(:mod:`controlplane.serving.health`), but the machine stays paid for until something ends it.
The reconciler does: on every tick it asks each running worker ``GET /health``
(:func:`http_probe`) and a worker that :class:`Liveness` finds *unresponsive* is terminated
(cause ``unresponsive``) and replaced by rule 5 in the same tick (docs/provisioners.md,
"Reconciler").

A worker is unresponsive when

- it answered before (in this process) and has not answered for ``after_s`` (60 s by default:
  twelve ticks of the reconciler, so that a worker busy past a probe's timeout, or a network
  blip, is not taken for dead), or
- it has never answered for ``never_after_s`` since it was first seen running (the straggler
  timeout, 600 s: an EC2 instance whose agent never came up; the provider's ``running`` says
  nothing of the agent, and a worker still downloading its model is not dead).

An answer is any JSON object with a ``status`` other than ``failed`` (``ok``, ``loading``,
``stopping`` all prove the agent lives; ``failed`` is an agent that could not load its models and
serves nothing). The probes of one tick run side by side, each with its own timeout, so a tick
takes at most about one timeout longer whatever the fleet's size.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from provisioners.base import ProvisionedInstance, with_port

logger = logging.getLogger(__name__)

DEFAULT_AFTER_S = 60.0
DEFAULT_PROBE_TIMEOUT_S = 2.0
MAX_PARALLEL_PROBES = 16

Probe = Callable[[ProvisionedInstance], bool]


def http_probe(port: int, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> Probe:
    """A probe asking a worker's agent ``GET /health`` at its address (``port`` where the address
    names none: an EC2 private IP), straight (no proxy), within ``timeout_s``; whether it
    answered (module docstring: any JSON object whose ``status`` is not ``failed``, whatever the
    HTTP status)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe(instance: ProvisionedInstance) -> bool:
        if not instance.address:
            return False
        url = f"http://{with_port(instance.address, port)}/health"
        try:
            with opener.open(url, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:  # 503 while loading or stopping: an answer
            try:
                raw = error.read()
            except OSError:
                return False
        except (OSError, ValueError):  # refused, timed out, reset, a bad address
            return False
        try:
            body = json.loads(raw)
        except ValueError:
            return False
        return isinstance(body, dict) and "status" in body and body["status"] != "failed"

    return probe


@dataclass
class _Seen:
    first_s: float  # when it was first seen running (this process's clock)
    answered_s: float | None = None  # its last answer


class Liveness:
    """Which running workers have stopped answering (module docstring). ``probe`` asks one
    worker; ``after_s`` and ``never_after_s`` are the two limits; times come from the caller
    (the reconciler's clock), so that a test steps them."""

    def __init__(
        self,
        probe: Probe,
        *,
        after_s: float = DEFAULT_AFTER_S,
        never_after_s: float,
    ) -> None:
        if not after_s > 0 or not never_after_s > 0:
            raise ValueError(
                f"after_s and never_after_s must be > 0, got {after_s!r} and {never_after_s!r}"
            )
        self.probe = probe
        self.after_s = after_s
        self.never_after_s = max(never_after_s, after_s)
        self._seen: dict[str, _Seen] = {}

    def check(self, instances: Iterable[ProvisionedInstance], now_s: float) -> dict[str, str]:
        """Probe every instance of ``instances`` the provider calls running (side by side) and
        return the unresponsive ones: provider id -> why. Instances no longer listed running
        are forgotten (a worker seen again starts afresh)."""
        running = {i.provider_id: i for i in instances if i.state == "running"}
        for gone in self._seen.keys() - running.keys():
            del self._seen[gone]
        if not running:
            return {}
        answers = self._probe_all(list(running.values()))
        unresponsive: dict[str, str] = {}
        for pid in running:
            seen = self._seen.setdefault(pid, _Seen(first_s=now_s))
            if answers[pid]:
                seen.answered_s = now_s
                continue
            why = self._verdict(seen, now_s)
            if why is not None:
                unresponsive[pid] = why
        return unresponsive

    def _verdict(self, seen: _Seen, now_s: float) -> str | None:
        if seen.answered_s is not None:
            silent_s = now_s - seen.answered_s
            if silent_s >= self.after_s:
                return f"its worker has not answered /health for {silent_s:.0f} s"
            return None
        waited_s = now_s - seen.first_s
        if waited_s >= self.never_after_s:
            return f"its worker never answered /health in {waited_s:.0f} s of running"
        return None

    def _probe_all(self, instances: list[ProvisionedInstance]) -> Mapping[str, bool]:
        def one(instance: ProvisionedInstance) -> bool:
            try:
                return self.probe(instance)
            except Exception:  # a probe is I/O: any failure is no answer
                logger.debug("liveness probe of %s failed", instance.provider_id, exc_info=True)
                return False

        if len(instances) == 1:
            return {instances[0].provider_id: one(instances[0])}
        workers = min(MAX_PARALLEL_PROBES, len(instances))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="liveness") as pool:
            answers = list(pool.map(one, instances))
        return {i.provider_id: answer for i, answer in zip(instances, answers, strict=True)}
