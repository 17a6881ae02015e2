"""The loops' feed and observation reads on the serving process's fast path
(:mod:`controlplane.api.fast_internal`): answered as the routes answer them, with the secret the
loops process is given, and everything unusual left to the routes (a wrong token, a malformed
body, a gear whose plan must be read from the store, an admin token)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.api import fast_internal
from controlplane.clock import FakeClock
from controlplane.loops.remote_serving import RemoteServing
from controlplane.serving.loop import ServingLoop
from controlplane.serving.observations import Split
from controlplane.settings import Settings
from tests.component.test_remote_serving import serving_app

SECRET = "loops-secret-0123456789"
LOOPS = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[ServingLoop, TestClient, dict[str, str]]]:
    """A serving app given the loops' secret (its loop not started: the observations are
    written by hand), its client and an admin and a viewer token."""
    settings = Settings(data_dir=tmp_path, provisioner="fake", internal_token=SECRET)
    yield from serving_app(settings)


@pytest.fixture
def fast_feeds(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The feeds the fast path answered (the routes call the same function under their own
    module's name, which this does not see)."""
    answered: list[Any] = []
    real: Callable[..., Any] = fast_internal.feed_document

    def recorded(services: Any, body: Any) -> Any:
        answered.append(body)
        return real(services, body)

    monkeypatch.setattr(fast_internal, "feed_document", recorded)
    return answered


def test_the_loops_reads_are_answered_on_the_fast_path_as_the_routes_answer_them(
    serving: tuple[ServingLoop, TestClient, dict[str, str]], fast_feeds: list[Any]
) -> None:
    loop, client, tokens = serving
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    observed = loop.observations
    for ms in (10.0, 12.0):
        observed.batch_served("toy", "tiny", "emu.cpu.large", 4, ms)
    observed.answered("toy", 50.0, 25.0, late=False, models=["tiny"], split=Split(api_ms=2.5))
    path = "/internal/v1/apps/toy/observations"
    fast = client.get(path, headers=LOOPS)
    assert fast.status_code == 200 and fast.headers["content-type"] == "application/json"
    assert fast.json() == client.get(path, headers=admin).json()
    assert fast.json()["batch_times_ms"] == [["tiny", "emu.cpu.large", {"4": [10.0, 12.0]}]]

    body = {"since_s": {"toy": 1.0}, "gears": {}, "recalibrated": ["toy"]}
    answer = client.post("/internal/v1/feed", json=body, headers=LOOPS)
    assert answer.status_code == 200 and len(fast_feeds) == 1
    assert answer.json() == client.post("/internal/v1/feed", json=body, headers=admin).json()
    assert len(fast_feeds) == 1  # the admin token's went to the route
    # The loops process's own reader takes the fast path's answers.
    remote = RemoteServing("http://testserver", SECRET, FakeClock(), client=client)
    assert remote.pull() and len(fast_feeds) == 2
    assert remote.observations.batch_times_ms("toy") == observed.batch_times_ms("toy")
    assert remote.observations.api_times_ms("toy") == [2.5]


def test_what_the_fast_path_does_not_take_is_answered_by_the_routes(
    serving: tuple[ServingLoop, TestClient, dict[str, str]], fast_feeds: list[Any]
) -> None:
    _loop, client, _tokens = serving
    wrong = {"Authorization": "Bearer not-the-secret"}
    assert client.post("/internal/v1/feed", json={}, headers=wrong).status_code == 401
    assert client.get("/internal/v1/apps/toy/observations", headers=wrong).status_code == 401
    assert client.post("/internal/v1/feed", json={}).status_code == 401
    malformed = client.post("/internal/v1/feed", json={"since_s": "soon"}, headers=LOOPS)
    assert malformed.status_code == 422
    assert client.post("/internal/v1/feed", content=b"{", headers=LOOPS).status_code == 422
    # Refused as the public routes refuse them (they were answered 200): a field no route
    # reads, a time that is no time, an id past the store's.
    for body in (b'{"bogus": 1}', b'{"since_s": {"toy": NaN}}', b'{"since_s": {"toy": Infinity}}'):
        assert client.post("/internal/v1/feed", content=body, headers=LOOPS).status_code == 422
    versions = "/internal/v1/apps/toy/versions?rollout_id=99999999999999999999&step_index=0"
    assert client.get(versions, headers=LOOPS).status_code == 422
    # The other internal routes take the secret through FastAPI, as before.
    window = client.post("/internal/v1/apps/toy/window", headers=LOOPS)
    assert window.status_code == 200 and window.json() is None
    assert fast_feeds == []


def test_a_gear_whose_plan_is_not_read_yet_is_set_by_the_route_then_kept_on_the_fast_path(
    serving: tuple[ServingLoop, TestClient, dict[str, str]],
    fast_feeds: list[Any],
    tmp_path: Path,
) -> None:
    from tests.component.test_live_gears import APP, FAST, PLAN, applied

    loop, client, _tokens = serving
    applied(loop.store, tmp_path, PLAN.to_document())
    plan = loop.store.get_applied_plan(APP)
    assert plan is not None and loop.gears is not None
    body = {"gears": {APP: [plan.id, 1]}}
    assert client.post("/internal/v1/feed", json=body, headers=LOOPS).status_code == 200
    assert fast_feeds == []  # the plan had to be read from the store: the route set it
    served = loop.gears(APP)
    assert served is not None and served.cascade == FAST.cascade
    assert client.post("/internal/v1/feed", json=body, headers=LOOPS).status_code == 200
    assert len(fast_feeds) == 1  # unchanged: the fast path
    body = {"gears": {APP: [plan.id, 0]}}  # another gear of a plan already parsed
    assert client.post("/internal/v1/feed", json=body, headers=LOOPS).status_code == 200
    assert len(fast_feeds) == 2
    served = loop.gears(APP)
    assert served is not None and served.cascade != FAST.cascade
    # A feed that leaves the gears out keeps them (a loops process whose switcher has not read
    # the store yet); one that names none serves the app by its spec.
    assert client.post("/internal/v1/feed", json={}, headers=LOOPS).status_code == 200
    assert loop.gears(APP) is not None and len(fast_feeds) == 3
    assert client.post("/internal/v1/feed", json={"gears": {}}, headers=LOOPS).status_code == 200
    assert loop.gears(APP) is None and len(fast_feeds) == 4
