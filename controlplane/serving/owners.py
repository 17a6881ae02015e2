"""Which serving process dispatches each app, when several serve one database (docs/service.md,
"Several serving processes"): one dispatcher per app, the others forwarding its queries.

A serving loop matches queries to the workers it knows as if it were alone (a worker serves one
batch at a time; the Kairos dispatcher's view of which worker is busy is the loop's own), so two
loops sending to the same workers would queue batches on them behind each other's. So each app
has one dispatching serving process: :class:`DispatchOwners` holds a lease per app in the
database (:meth:`~controlplane.db.store.Store.hold_dispatchers`: it renews its own and takes
any app whose lease has ended or that has none, every :data:`DISPATCH_RENEW_S`, each lease
:data:`DISPATCH_LEASE_S` long) and says, per app, where its dispatcher is
(:meth:`DispatchOwners.forward_to`); :mod:`controlplane.api.forwarding` sends the app's
inference requests there. A serving process that stops gives its leases up; one that dies
leaves them to end, and until then the others serve its apps themselves when the forward finds
nobody (the forwarding middleware's fallback).

A serving process takes leases only once it has reached itself at the URL it advertises
(``probe``: its ``/healthz`` answers with this process's :attr:`DispatchOwners.owner`). A
``dispatch_url`` that reaches nobody, or another process, made a dispatcher the others could not
forward to: they served its apps themselves, two matchers on one fleet for as long as it ran.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime

from controlplane.clock import Clock
from controlplane.db.store import DispatcherRecord, Store
from controlplane.errors import DatabaseError
from controlplane.repeating import Repeating

__all__ = ["DISPATCH_LEASE_S", "DISPATCH_RENEW_S", "DispatchOwners"]

logger = logging.getLogger(__name__)

# An app's dispatch lease lasts DISPATCH_LEASE_S and its owner renews it every DISPATCH_RENEW_S:
# a dead owner's apps are taken over within DISPATCH_LEASE_S + DISPATCH_RENEW_S.
DISPATCH_LEASE_S = 10.0
DISPATCH_RENEW_S = 2.0


class DispatchOwners:
    """This serving process's dispatch leases, as ``url`` (where the others reach it), over
    ``store`` (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        url: str,
        *,
        lease_s: float = DISPATCH_LEASE_S,
        renew_s: float = DISPATCH_RENEW_S,
        probe: Callable[[str], str | None] | None = None,
    ) -> None:
        if not 0 < renew_s < lease_s:
            raise ValueError(f"renew_s must be in (0, lease_s), got {renew_s!r}, {lease_s!r}")
        self.store = store
        self.clock = clock
        self.url = url.rstrip("/")
        self.owner = uuid.uuid4().hex
        self.lease_s = float(lease_s)
        self.renew_s = float(renew_s)
        self._owners: dict[str, DispatcherRecord] = {}
        self._rounds = Repeating(self.hold, self.renew_s, "dispatch-leases", "dispatch leases")
        self._failing = False
        # ``probe(url)``: the owner id the process at ``url`` answers with, None when nobody
        # answers. Without one (a test's), this process is taken as reachable.
        self.probe = probe
        self.reachable = probe is None
        self._said: str | None = None  # the last thing said of the probe (said once)

    def forward_to(self, app: str) -> str | None:
        """The base URL of ``app``'s dispatcher when it is another serving process whose lease
        runs; None when this process dispatches it (its own, not taken yet, or lapsed)."""
        found = self._owners.get(app)
        if found is None or found.owner == self.owner:
            return None
        return found.url if found.expires_at > self.clock.utcnow() else None

    def owns(self, app: str) -> bool:
        found = self._owners.get(app)
        return found is not None and found.owner == self.owner

    def check_reachable(self) -> bool:
        """Whether this process answers at its URL (``probe``; once it did, it is not asked
        again). Said once per outcome: a URL that reaches nobody (a warning: it may be this
        process not listening yet) or another process (an error: ``dispatch_url`` is wrong)."""
        if self.reachable or self.probe is None:
            return True
        found = self.probe(self.url)
        if found == self.owner:
            self.reachable = True
            if self._said is not None:
                logger.info("dispatch leases: this process answers at %s now", self.url)
            return True
        said = "nobody" if found is None else "another"
        if said != self._said:
            self._said = said
            if found is None:
                logger.warning(
                    "dispatch leases: nothing answers at %s, where this process says the others"
                    " reach it: it dispatches no app for them until it answers there (set"
                    " dispatch_url to its address)",
                    self.url,
                )
            else:
                logger.error(
                    "dispatch leases: %s reaches another serving process, not this one: this"
                    " one dispatches no app for the others (set dispatch_url to its address)",
                    self.url,
                )
        return False

    def hold(self, at: datetime | None = None, *, probe: bool = True) -> None:
        """One round: renew and take leases (once this process answers at its URL:
        :meth:`check_reachable`, asked when ``probe``), read every app's dispatcher (a database
        failure is logged once per outage; the last reading stays)."""
        take = self.check_reachable() if probe else self.reachable
        try:
            self._owners = self.store.hold_dispatchers(
                self.owner, self.url, lease_s=self.lease_s, at=at, take=take
            )
        except DatabaseError as error:
            if not self._failing:
                logger.warning("dispatch leases: %s", error)
            self._failing = True
            return
        if self._failing:
            logger.info("dispatch leases: the database answers again")
        self._failing = False

    def start(self) -> None:
        """One round now (without the probe: the process may not answer on its socket before
        it has started), then one every ``renew_s`` on a daemon thread until :meth:`close`."""
        self.hold(probe=False)
        self._rounds.start()

    def close(self) -> None:
        """Stop renewing and give the leases up (the others take the apps at their next round)."""
        self._rounds.stop()
        try:
            self.store.release_dispatchers(self.owner)
        except DatabaseError as error:
            logger.warning("dispatch leases not released (they will lapse): %s", error)
