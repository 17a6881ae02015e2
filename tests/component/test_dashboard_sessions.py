"""The dashboard's server-side sessions (controlplane/dashboard/session.py) through FastAPI's
TestClient on a real SQLite file with a fake clock: the cookie holds a session id and never the
token; a session ends when it expires, when its token is revoked or deleted, and at sign-out; it
is shared by two API apps on one database (two replicas); the cookie is ``Secure`` whenever TLS
is on (the setting, or the request's scheme)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from controlplane.clock import FakeClock
from controlplane.dashboard import COOKIE_NAME, SessionSettings
from controlplane.dashboard.session import load_session_settings
from controlplane.db.store import Store
from controlplane.errors import InvalidValueError, NotFoundError, SettingsError
from controlplane.service.app import create_app
from controlplane.settings import Settings
from tests.component.test_api import write_profiles

LIFETIME_S = 3600.0


@dataclass
class Site:
    settings: Settings
    store: Store
    clock: FakeClock
    token: str

    def client(
        self,
        sessions: SessionSettings | None = None,
        *,
        base_url: str = "http://testserver",
        cookies: dict[str, str] | None = None,
    ) -> TestClient:
        """A client of a new API app on the same database (another replica, as it were)."""
        app = create_app(self.settings, self.store, self.clock)
        app.state.dashboard.sessions = sessions or SessionSettings(session_lifetime_s=LIFETIME_S)
        return TestClient(app, base_url=base_url, cookies=cookies, raise_server_exceptions=False)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    settings = Settings(data_dir=data_dir, provisioner="fake")
    clock = FakeClock()
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    token = store.create_token("viewer", name="viewer-token")
    yield Site(settings, store, clock, token)
    store.close()


def sign_in(client: TestClient, token: str) -> httpx.Response:
    answer: httpx.Response = client.post(
        "/dashboard/login", data={"token": token}, follow_redirects=False
    )
    assert answer.status_code == 303, answer.text
    return answer


def database_text(site: Site) -> str:
    """Every value of the sessions table, as text."""
    with sqlite3.connect(site.settings.data_dir / "heteroplane.db") as connection:
        rows = connection.execute("SELECT * FROM dashboard_sessions").fetchall()
    return repr(rows)


def test_the_cookie_holds_a_session_id_never_the_token(site: Site) -> None:
    with site.client() as client:
        answer = sign_in(client, site.token)
        cookie = answer.headers["set-cookie"]
        assert site.token not in cookie
        session_id = client.cookies[COOKIE_NAME]
        assert session_id.startswith("hs_") and len(session_id) >= 40
        assert session_id != site.token
        for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard", "Max-Age=3600"):
            assert attribute in cookie
        # The database holds neither the session id nor the token.
        stored = database_text(site)
        assert site.store.count_dashboard_sessions(token="viewer-token") == 1
        assert session_id not in stored and site.token not in stored
        assert client.get("/dashboard/data").status_code == 200
        # Two sign-ins, two sessions.
        with site.client() as other:
            sign_in(other, site.token)
            assert other.cookies[COOKIE_NAME] != session_id
        assert site.store.count_dashboard_sessions() == 2


def test_a_token_in_the_cookie_opens_nothing(site: Site) -> None:
    with site.client(cookies={COOKIE_NAME: site.token}) as client:
        assert client.get("/dashboard/data").status_code == 401
        page = client.get("/dashboard")
        assert page.status_code == 401 and f'{COOKIE_NAME}=""' in page.headers["set-cookie"]


def test_an_expired_session_is_refused(site: Site) -> None:
    with site.client() as client:
        sign_in(client, site.token)
        site.clock.advance(LIFETIME_S - 1)
        assert client.get("/dashboard/data").status_code == 200
        site.clock.advance(1)
        refused = client.get("/dashboard/data")
        assert refused.status_code == 401 and "ended" in refused.text
        # ... and it is gone from the database.
        assert site.store.count_dashboard_sessions() == 0


def test_the_form_says_the_sign_in_ended_once_the_browser_dropped_the_cookie(site: Site) -> None:
    # The page's poll found the sign-in gone (and the browser dropped the expired cookie): the
    # form says why, and signing in opens the page on the app, window and kind it showed.
    with site.client(SessionSettings(session_lifetime_s=25)) as client:
        form = client.get("/dashboard", params={"ended": "1", "app": "toy", "window_s": "300"})
        assert form.status_code == 401 and "sign-in has ended" in form.text
        assert 'action="/dashboard/login?app=toy&amp;window_s=300"' in form.text
        # The hint gives the configured lifetime, and says the token is never kept.
        assert "for 25 seconds or until you sign out" in form.text and "8 hours" not in form.text
        plain = client.get("/dashboard")
        assert plain.status_code == 200 and "sign-in has ended" not in plain.text
        answer = client.post(
            "/dashboard/login?app=toy&window_s=300&kind=scale_up",
            data={"token": site.token},
            follow_redirects=False,
        )
        assert answer.status_code == 303
        assert answer.headers["location"] == "/dashboard?app=toy&window_s=300&kind=scale_up"
        # What the page could not use is dropped, never passed on.
        client.cookies.clear()
        answer = client.post(
            "/dashboard/login?app=Demo&window_s=30&next=https://example.com",
            data={"token": site.token},
            follow_redirects=False,
        )
        assert answer.status_code == 303 and answer.headers["location"] == "/dashboard"
        # A name or kind with a newline after it is not one the page can use either.
        client.cookies.clear()
        answer = client.post(
            "/dashboard/login?app=toy%0A&window_s=300&kind=scale_up%0A",
            data={"token": site.token},
            follow_redirects=False,
        )
        assert answer.status_code == 303
        assert answer.headers["location"] == "/dashboard?window_s=300"
    with site.client() as client:
        assert "for 1 hour or until you sign out" in client.get("/dashboard").text


def test_ended_sessions_are_pruned_at_the_next_sign_in(site: Site) -> None:
    with site.client() as client:
        sign_in(client, site.token)
        site.clock.advance(LIFETIME_S + 1)
        sign_in(client, site.token)
        assert site.store.count_dashboard_sessions() == 1


def test_a_revoked_tokens_session_is_refused(site: Site) -> None:
    with site.client() as client:
        sign_in(client, site.token)
        site.store.revoke_token("viewer-token")
        assert client.get("/dashboard/data").status_code == 401
        page = client.get("/dashboard")
        assert page.status_code == 401 and "sign-in has ended" in page.text
        assert site.store.count_dashboard_sessions() == 0


def test_deleting_the_token_deletes_its_sessions(site: Site) -> None:
    with site.client() as client:
        sign_in(client, site.token)
    assert site.store.count_dashboard_sessions() == 1
    with sqlite3.connect(site.settings.data_dir / "heteroplane.db") as connection:
        connection.execute("PRAGMA foreign_keys = ON")
        connection.execute("DELETE FROM api_tokens WHERE name = 'viewer-token'")
    assert site.store.count_dashboard_sessions() == 0


def test_sign_out_deletes_the_session(site: Site) -> None:
    with site.client() as client:
        sign_in(client, site.token)
        session_id = client.cookies[COOKIE_NAME]
        out = client.post("/dashboard/logout", follow_redirects=False)
        assert out.status_code == 303 and f'{COOKIE_NAME}=""' in out.headers["set-cookie"]
    assert site.store.count_dashboard_sessions() == 0
    # A copy of the cookie taken before the sign-out opens nothing.
    with site.client(cookies={COOKIE_NAME: session_id}) as copied:
        assert copied.get("/dashboard/data").status_code == 401


def test_a_session_is_shared_by_every_replica(site: Site) -> None:
    with site.client() as first, site.client() as second:
        sign_in(first, site.token)
        second.cookies.set(COOKIE_NAME, first.cookies[COOKIE_NAME], path="/dashboard")
        assert second.get("/dashboard/data").status_code == 200
        assert second.post("/dashboard/logout", follow_redirects=False).status_code == 303
        assert first.get("/dashboard/data").status_code == 401


@pytest.mark.parametrize(
    ("secure_cookie", "base_url", "secure"),
    [
        (False, "http://testserver", False),
        (False, "https://testserver", True),
        (True, "http://testserver", True),
    ],
)
def test_the_cookie_is_secure_whenever_tls_is_on(
    site: Site, secure_cookie: bool, base_url: str, secure: bool
) -> None:
    sessions = SessionSettings(secure_cookie=secure_cookie, session_lifetime_s=LIFETIME_S)
    with site.client(sessions, base_url=base_url) as client:
        answer = client.post("/dashboard/login", data={"token": site.token}, follow_redirects=False)
        assert answer.status_code == 303
        assert ("Secure" in answer.headers["set-cookie"]) is secure
        out = client.post("/dashboard/logout", follow_redirects=False)
        assert ("Secure" in out.headers["set-cookie"]) is secure


def test_the_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SessionSettings().secure_cookie is False
    monkeypatch.setenv("HETEROPLANE_DASHBOARD_SECURE_COOKIE", "true")
    monkeypatch.setenv("HETEROPLANE_DASHBOARD_SESSION_LIFETIME_S", "600")
    settings = SessionSettings()
    assert settings.secure_cookie is True and settings.session_lifetime_s == 600
    monkeypatch.setenv("HETEROPLANE_DASHBOARD_SESSION_LIFETIME_S", "0")
    with pytest.raises(ValidationError):
        SessionSettings()
    # What serve reads: one line naming the variable.
    with pytest.raises(SettingsError) as refused:
        load_session_settings()
    assert str(refused.value) == (
        "dashboard.session_lifetime_s: must be greater than or equal to 1, got '0'"
        " (HETEROPLANE_DASHBOARD_SESSION_LIFETIME_S)"
    )
    # Under a second the cookie's Max-Age (whole seconds) was 0: the browser dropped it at
    # once, and no sign-in ever held.
    monkeypatch.setenv("HETEROPLANE_DASHBOARD_SESSION_LIFETIME_S", "0.5")
    with pytest.raises(SettingsError, match=r"must be greater than or equal to 1, got '0\.5'"):
        load_session_settings()


def test_a_form_of_too_many_fields_is_a_400(site: Site) -> None:
    fields = "&".join(f"f{n}=1" for n in range(8))
    out = site.client().post(
        "/dashboard/login",
        content=f"{fields}&token={site.token}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert out.status_code == 400
    assert "Sign in with the form" in out.text


def test_the_store_refuses_what_is_not_a_live_token(site: Site) -> None:
    with pytest.raises(NotFoundError):
        site.store.open_dashboard_session("hp_unknown", lifetime_s=60)
    with pytest.raises(InvalidValueError):
        site.store.open_dashboard_session(site.token, lifetime_s=0)
    site.store.revoke_token("viewer-token")
    with pytest.raises(NotFoundError):
        site.store.open_dashboard_session(site.token, lifetime_s=60)
    assert site.store.verify_dashboard_session("hs_unknown") is None
    assert site.store.verify_dashboard_session(site.token) is None
    assert site.store.close_dashboard_session("hs_unknown") is False
