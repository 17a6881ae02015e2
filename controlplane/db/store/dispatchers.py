"""Which serving process dispatches each app when several serve one database (docs/service.md,
"Several serving processes"): a lease per app in ``app_dispatchers``, held by one serving
process and renewed by it; the others forward the app's inference requests to its URL."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import StoreBase, _number, _translated

__all__ = ["DispatcherRecord", "DispatcherStore"]


@dataclass(frozen=True, slots=True)
class DispatcherRecord:
    """An app's dispatcher: the serving process ``owner`` at ``url``, until ``expires_at``."""

    app: str
    owner: str
    url: str
    expires_at: datetime


class DispatcherStore(StoreBase):
    """The apps' dispatch leases (see the module docstring)."""

    @_translated
    def hold_dispatchers(
        self,
        owner: str,
        url: str,
        *,
        lease_s: float,
        at: datetime | None = None,
        take: bool = True,
    ) -> dict[str, DispatcherRecord]:
        """Renew ``owner``'s leases and take every app whose lease has ended or that has none,
        each until ``lease_s`` from now (compare-and-set on the lease read: of two serving
        processes that race for an app, one gets it); every app's dispatcher afterwards. With
        ``take`` false, only the reading (a serving process not known to be reachable at
        ``url`` dispatches nothing for the others)."""
        lease = timedelta(seconds=_number(lease_s, "lease_s", positive=True))
        now = self._now(at)
        with transaction(self._sessions) as session:
            held = {
                row.app_id: (row.owner, row.expires_at)
                for row in session.scalars(select(m.AppDispatcher))
            }
            for app_id in session.scalars(select(m.App.id)) if take else ():
                seen = held.get(app_id)
                if seen is None:
                    try:
                        with session.begin_nested():
                            session.add(
                                m.AppDispatcher(
                                    app_id=app_id, owner=owner, url=url, expires_at=now + lease
                                )
                            )
                    except IntegrityError:
                        pass  # another serving process took it first
                elif seen[0] == owner or seen[1] <= now:
                    session.execute(
                        update(m.AppDispatcher)
                        .where(
                            m.AppDispatcher.app_id == app_id,
                            m.AppDispatcher.owner == seen[0],
                            m.AppDispatcher.expires_at == seen[1],
                        )
                        .values(owner=owner, url=url, expires_at=now + lease)
                    )
            rows = session.execute(
                select(m.App.name, m.AppDispatcher).join(
                    m.AppDispatcher, m.AppDispatcher.app_id == m.App.id
                )
            ).all()
            return {
                name: DispatcherRecord(name, row.owner, row.url, row.expires_at)
                for name, row in rows
            }

    @_translated
    def release_dispatchers(self, owner: str) -> int:
        """Give up ``owner``'s leases (a serving process that stops), so that another serving
        process takes its apps at its next round; how many were released."""
        with transaction(self._sessions) as session:
            done = session.execute(delete(m.AppDispatcher).where(m.AppDispatcher.owner == owner))
            return int(getattr(done, "rowcount", 0) or 0)
