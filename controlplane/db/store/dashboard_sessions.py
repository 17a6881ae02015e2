"""The dashboard's sign-ins: a random session id per browser, its SHA-256 in the database
(every replica of the API sees the same sign-ins)."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _number,
    _translated,
)
from controlplane.db.store.records import Principal
from controlplane.errors import NotFoundError
from controlplane.policies import auth

__all__ = ["DashboardSessionStore"]


class DashboardSessionStore(StoreBase):
    """The dashboard's sign-ins (see the module docstring)."""

    # --- dashboard sessions --------------------------------------------------------------------
    # The dashboard's sign-ins (controlplane/dashboard/routes.py): the browser's cookie holds a
    # random session id, the table its SHA-256, the token it was opened with and when it ends.
    # In the database, so that every replica of the API sees the same sign-ins.

    # A session id starts so: never mistaken for an API token (hp_...).
    DASHBOARD_SESSION_PREFIX = "hs_"

    @_translated
    def open_dashboard_session(
        self, token: str, *, lifetime_s: float, at: datetime | None = None
    ) -> str:
        """Open a sign-in for ``token`` that ends ``lifetime_s`` from now; return its session id
        (``hs_`` and 43 URL-safe characters, 256 bits), shown this once: only its SHA-256 is
        kept. :class:`NotFoundError` when the token is unknown or revoked. Sessions that have
        ended (of any token) are deleted on the way, so the table holds live ones only."""
        lifetime = _number(lifetime_s, "lifetime_s", positive=True)
        now = self._now(at)
        session_id = self.DASHBOARD_SESSION_PREFIX + secrets.token_urlsafe(32)
        with transaction(self._sessions) as session:
            session.execute(delete(m.DashboardSession).where(m.DashboardSession.expires_at <= now))
            row = (
                session.scalar(
                    select(m.ApiToken).where(m.ApiToken.token_hash == auth.hash_token(token))
                )
                if auth.looks_like_token(token)
                else None
            )
            if row is None or row.revoked_at is not None:
                raise NotFoundError("token", "(the one given)")
            session.add(
                m.DashboardSession(
                    session_hash=auth.hash_token(session_id),
                    token_id=row.id,
                    created_at=now,
                    expires_at=now + timedelta(seconds=lifetime),
                )
            )
        return session_id

    @_translated
    def verify_dashboard_session(
        self, session_id: str, *, at: datetime | None = None
    ) -> Principal | None:
        """Who the sign-in ``session_id`` belongs to, or None when it is unknown, has ended, or
        its token has been revoked (an ended or revoked one is deleted)."""
        if not session_id.startswith(self.DASHBOARD_SESSION_PREFIX) or len(session_id) > 128:
            return None
        digest = auth.hash_token(session_id)
        now = self._now(at)
        with transaction(self._sessions) as session:
            found = session.execute(
                select(m.DashboardSession, m.ApiToken)
                .join(m.ApiToken, m.ApiToken.id == m.DashboardSession.token_id)
                .where(m.DashboardSession.session_hash == digest)
            ).one_or_none()
            if found is None:
                return None
            row, token = found
            if not auth.hashes_match(session_id, row.session_hash):
                return None
            if row.expires_at <= now or token.revoked_at is not None:
                session.delete(row)
                return None
            return Principal(token.name, token.scope)

    @_translated
    def close_dashboard_session(self, session_id: str) -> bool:
        """End the sign-in ``session_id`` (sign-out); whether there was one."""
        digest = auth.hash_token(session_id)
        with transaction(self._sessions) as session:
            result = session.execute(
                delete(m.DashboardSession).where(m.DashboardSession.session_hash == digest)
            )
            return int(cast(CursorResult[Any], result).rowcount) > 0

    @_translated
    def count_dashboard_sessions(self, *, token: str | None = None) -> int:
        """How many sign-ins are stored (of the token named ``token``, or of all)."""
        query = select(func.count()).select_from(m.DashboardSession)
        if token is not None:
            query = query.join(m.ApiToken, m.ApiToken.id == m.DashboardSession.token_id).where(
                m.ApiToken.name == token
            )
        with transaction(self._sessions) as session:
            return int(session.scalar(query) or 0)
