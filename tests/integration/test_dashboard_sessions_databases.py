"""The dashboard's sessions in the store on real databases (a SQLite file and a throwaway
PostgreSQL server, through the migrations): a session opens for a live token only, ends when it
expires, when its token is revoked, when its token's row is deleted (``ON DELETE CASCADE``) and
at sign-out; the database keeps neither the session id nor the token."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from controlplane.db.session import make_engine
from controlplane.db.store import Store
from controlplane.errors import NotFoundError

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def _stored(url: str) -> str:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return repr(connection.execute(text("SELECT * FROM dashboard_sessions")).all())
    finally:
        engine.dispose()


def test_sessions_on_both_databases(database_url: str) -> None:
    store = Store.from_url(database_url, upgrade=True)
    try:
        token = store.create_token("viewer", name="alice", at=T0)
        session_id = store.open_dashboard_session(token, lifetime_s=3600, at=T0)
        stored = _stored(database_url)
        assert session_id not in stored and token not in stored
        at = T0 + timedelta(seconds=3599)
        assert store.verify_dashboard_session(session_id, at=at) == ("alice", "viewer")
        assert store.verify_dashboard_session(session_id, at=T0 + timedelta(hours=1)) is None
        assert store.count_dashboard_sessions() == 0  # ended: deleted when met

        second = store.open_dashboard_session(token, lifetime_s=3600, at=T0)
        assert store.close_dashboard_session(second) is True
        assert store.verify_dashboard_session(second, at=T0) is None

        third = store.open_dashboard_session(token, lifetime_s=3600, at=T0)
        store.revoke_token("alice", at=T0)
        assert store.verify_dashboard_session(third, at=T0) is None
        with pytest.raises(NotFoundError):
            store.open_dashboard_session(token, lifetime_s=3600, at=T0)

        bob = store.create_token("viewer", name="bob", at=T0)
        store.open_dashboard_session(bob, lifetime_s=3600, at=T0)
        assert store.count_dashboard_sessions(token="bob") == 1
        engine = make_engine(database_url)
        try:
            with engine.begin() as connection:
                connection.execute(text("DELETE FROM api_tokens WHERE name = 'bob'"))
        finally:
            engine.dispose()
        assert store.count_dashboard_sessions() == 0
    finally:
        store.close()
