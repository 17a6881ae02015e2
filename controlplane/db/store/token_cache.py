"""The store's cache of verified tokens: who a token belongs to, trusted for ``TOKEN_CACHE_S``.

The inference path checks a token per request; :meth:`~controlplane.db.store.Store.verify_token`
answers from here for a second (on the store's clock) instead of reading the database each time.
The entries live in a :class:`cachetools.TLRUCache` (each expires at its own time, the least
recently used goes when ``TOKEN_CACHE_MAX`` are held). A revocation through this store empties it
at once (:meth:`TokenCache.revoked`), and an answer read before a revocation but stored after it
is not kept (the revocations are counted: :meth:`TokenCache.generation`); one through another
replica's store is seen within ``TOKEN_CACHE_S``.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

from cachetools import TLRUCache

from controlplane.db.store.records import Principal

__all__ = [
    "TOKEN_CACHE_MAX",
    "TOKEN_CACHE_S",
    "TOKEN_OUTAGE_S",
    "CachedPrincipal",
    "TokenCache",
]

# How long verify_token trusts its own answer (on the store's clock), and how many it keeps. A
# token revoked through another replica's store stops working here within this time.
TOKEN_CACHE_S = 1.0
TOKEN_CACHE_MAX = 1024
# While the database does not answer, how long after its last verification a token still
# stands (verify_token's answer then, for TOKEN_CACHE_S at a time): the serving path answers on
# the fleet it has through an outage of the database, where every query was a 503 once its
# token's second had passed. A revocation cannot be written while the database is down; one
# through this store forgets these too.
TOKEN_OUTAGE_S = 300.0


class _WallClock(Protocol):
    def utcnow(self) -> datetime: ...


class CachedPrincipal(NamedTuple):
    """Who a token belongs to, until when."""

    principal: Principal
    expires_at: datetime


class TokenCache:
    """Verified tokens by their digest, each for ``TOKEN_CACHE_S`` (see the module docstring);
    thread-safe."""

    def __init__(self, clock: _WallClock, *, max_entries: int = TOKEN_CACHE_MAX) -> None:
        self._entries: TLRUCache[str, CachedPrincipal] = TLRUCache(
            maxsize=max_entries,
            ttu=lambda _digest, entry, _now: entry.expires_at.timestamp(),
            timer=lambda: clock.utcnow().timestamp(),
        )
        # The last verified answer per token, for a database outage (TOKEN_OUTAGE_S).
        self._known: TLRUCache[str, CachedPrincipal] = TLRUCache(
            maxsize=max_entries,
            ttu=lambda _digest, entry, _now: entry.expires_at.timestamp() + TOKEN_OUTAGE_S,
            timer=lambda: clock.utcnow().timestamp(),
        )
        self._lock = threading.Lock()
        self._generation = 0  # bumped by each revocation

    def get(self, digest: str, now: datetime) -> CachedPrincipal | None:
        """The answer cached for ``digest`` while it has not expired at ``now``."""
        with self._lock:
            entry = self._entries.get(digest)
        return entry if entry is not None and now < entry.expires_at else None

    def generation(self) -> int:
        """How many revocations this cache has seen: read before a database lookup, given back
        to :meth:`put`."""
        with self._lock:
            return self._generation

    def put(self, digest: str, principal: Principal | None, now: datetime, generation: int) -> None:
        """Cache what a lookup that started at ``generation`` found (``None``: the token is not
        valid, and leaves the cache); not kept when a revocation came in between."""
        with self._lock:
            if principal is None:
                self._entries.pop(digest, None)
                self._known.pop(digest, None)
            elif generation == self._generation:
                expires_at = now + timedelta(seconds=TOKEN_CACHE_S)
                self._entries[digest] = CachedPrincipal(principal, expires_at)
                self._known[digest] = CachedPrincipal(principal, expires_at)

    def outage(self, digest: str, now: datetime) -> Principal | None:
        """Who ``digest``'s token belonged to when last verified, within ``TOKEN_OUTAGE_S`` of
        that answer's expiry at ``now``, for a lookup the database could not answer; cached
        again for ``TOKEN_CACHE_S`` (the fast path's reads stay off the database meanwhile).
        None when there is none."""
        with self._lock:
            known = self._known.get(digest)
            if known is None or now >= known.expires_at + timedelta(seconds=TOKEN_OUTAGE_S):
                return None
            self._entries[digest] = CachedPrincipal(
                known.principal, now + timedelta(seconds=TOKEN_CACHE_S)
            )
            return known.principal

    def revoked(self) -> None:
        """A token was revoked: forget every answer, and any lookup under way."""
        with self._lock:
            self._entries.clear()
            self._known.clear()
            self._generation += 1
