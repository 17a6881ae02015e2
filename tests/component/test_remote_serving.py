"""The loops' view of a serving process running apart (:class:`RemoteServing`) against the
serving app's internal routes in process, and its feed's bookkeeping against a scripted one:
arrivals kept and moved onto the loops' clock, asked for from the newest one held, the gears and
the recalibrated apps sent, an outage read as nothing served.

The real processes (PostgreSQL, local workers, a SIGKILL of the loops' leader) are in
tests/integration/test_serving_apart.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.apps.resolver import AppResolver
from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.loops.live_gears import GearTable
from controlplane.loops.remote_serving import RemoteServing
from controlplane.service.app import create_app
from controlplane.service.build import build_calibrator
from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus
from controlplane.serving.loop import ServingLoop
from controlplane.serving.observations import CPU_MIN_QUERIES, CPU_WINDOW_S, Split
from controlplane.serving.states import Overload
from controlplane.serving.wire import status_from_json, status_to_json
from controlplane.serving.workers import StaticInstances
from controlplane.settings import Settings


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[ServingLoop, TestClient, dict[str, str]]]:
    """A serving app (its loop not started: the observations are written by hand), its client
    and an admin and a viewer token."""
    yield from serving_app(Settings(data_dir=tmp_path, provisioner="fake"))


def serving_app(settings: Settings) -> Iterator[tuple[ServingLoop, TestClient, dict[str, str]]]:
    """:func:`serving` on ``settings``."""
    tmp_path = settings.data_dir
    clock = FakeClock(start_s=50.0)
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    tokens = {scope: store.create_token(scope, name=scope) for scope in ("admin", "viewer")}
    resolver = AppResolver(tmp_path)
    table = GearTable(store)
    loop = ServingLoop(store, resolver, StaticInstances(), clock=clock, gears=table.gear)
    app = create_app(settings, store, clock, serving=loop, resolver=resolver, gear_table=table)
    with TestClient(app) as client:
        yield loop, client, tokens
    store.close()


def test_the_loops_read_the_calibrations_times_and_the_windows_of_the_serving_process(
    serving: tuple[ServingLoop, TestClient, dict[str, str]],
) -> None:
    loop, client, tokens = serving
    assert client.get("/healthz").json()["role"] == "serving"
    observed = loop.observations
    for ms in (10.0, 12.0, 11.0):
        observed.batch_served("toy", "tiny", "emu.cpu.large", 4, ms)
    observed.batch_served("toy", "large", "emu.gpu.small", 1, 30.0)
    observed.arrival("toy", 50.0)
    observed.answered("toy", 50.0, 25.0, late=False, models=["tiny"], split=Split(api_ms=2.5))
    remote = RemoteServing("http://testserver", tokens["admin"], FakeClock(), client=client)

    assert remote.observations.batch_times_ms("toy") == observed.batch_times_ms("toy")
    assert remote.observations.batch_times_ms("toy")[("tiny", "emu.cpu.large")] == {
        4: [10.0, 12.0, 11.0]
    }
    assert remote.observations.api_times_ms("toy") == observed.api_times_ms("toy") == [2.5]
    # The serving process's CPU per query: none before a window of enough answers closes on the
    # serving process's clock, then its figure, read through the same route.
    assert remote.observations.serving_cpu_ms("toy", 0.0) is None
    for _ in range(CPU_MIN_QUERIES):
        observed.answered("toy", 50.0, 25.0, late=False, models=["tiny"], split=Split(api_ms=2.5))
    assert isinstance(loop.clock, FakeClock)
    loop.clock.advance(CPU_WINDOW_S)
    cpu_ms = remote.observations.serving_cpu_ms("toy", 0.0)
    assert cpu_ms is not None and cpu_ms >= 0.0
    assert observed.serving_cpu_ms("toy", loop.clock.now_s()) == cpu_ms
    remote.observations.forget_batch_times("toy", "tiny", "emu.cpu.large")
    assert set(observed.batch_times_ms("toy")) == {("large", "emu.gpu.small")}
    remote.observations.forget_api_times("toy")  # measured beside a profile run's worker
    assert observed.api_times_ms("toy") == remote.observations.api_times_ms("toy") == []
    # No dispatcher for it: the loop serves nothing, so no window and no app in the feed.
    assert remote.take_window("toy") is None
    assert remote.pull() and remote.observed_arrivals("toy") is None and remote.statuses() == []


def test_the_internal_routes_take_an_admin_token(
    serving: tuple[ServingLoop, TestClient, dict[str, str]],
) -> None:
    _loop, client, tokens = serving
    assert client.post("/internal/v1/feed", json={}).status_code == 401
    viewer = {"Authorization": f"Bearer {tokens['viewer']}"}
    assert client.post("/internal/v1/feed", json={}, headers=viewer).status_code == 403
    remote = RemoteServing("http://testserver", tokens["viewer"], FakeClock(), client=client)
    assert not remote.pull()  # refused: read as nothing served
    assert remote.observations.batch_times_ms("toy") == {}
    assert "/internal/" not in json.dumps(client.get("/openapi.json").json()["paths"])


class ScriptedFeed:
    """A serving process's feed answered from a script: its clock and each app's arrivals."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.arrivals: dict[str, list[float]] = {}
        self.status: dict[str, Any] | None = None
        self.down = False
        self.asked: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("refused", request=request)
        assert request.url.path == "/internal/v1/feed"
        assert request.headers["Authorization"] == "Bearer hp_admin"
        body = json.loads(request.content)
        self.asked.append(body)
        apps = {}
        for app, times in self.arrivals.items():
            since = body["since_s"].get(app, -np.inf)
            apps[app] = {"arrivals_s": [t for t in times if t > since], "status": self.status}
        return httpx.Response(200, json={"now_s": self.now_s, "apps": apps})


def test_the_feed_keeps_the_arrivals_on_the_loops_clock_and_sends_the_gears() -> None:
    feed, clock = ScriptedFeed(), FakeClock(start_s=10.0)
    client = httpx.Client(transport=httpx.MockTransport(feed.handle))
    remote = RemoteServing("http://serving:8000", "hp_admin", clock, client=client)
    remote.gears = lambda: {"toy": (7, 1)}
    feed.arrivals["toy"] = [998.0, 999.0]
    assert remote.pull()
    # The serving clock reads 1000 when this one reads 10: its arrivals are 990 s earlier here.
    np.testing.assert_allclose(remote.observed_arrivals("toy"), [8.0, 9.0])  # type: ignore[arg-type]
    assert feed.asked[-1]["gears"] == {"toy": [7, 1]}
    assert remote.observed_arrivals("other") is None  # not served there

    feed.arrivals["toy"] += [1000.5]
    feed.now_s = 1001.0
    clock.advance(1.0)
    remote.recalibrated("toy")
    assert remote.pull()
    assert feed.asked[-1]["since_s"] == {"toy": 999.0}  # only the newer ones come
    assert feed.asked[-1]["recalibrated"] == ["toy"]
    np.testing.assert_allclose(remote.observed_arrivals("toy"), [8.0, 9.0, 10.5])  # type: ignore[arg-type]

    feed.down = True
    remote.recalibrated("toy")
    assert not remote.pull()
    assert remote.observed_arrivals("toy") is None and remote.statuses() == []
    feed.down = False
    assert remote.pull()
    assert feed.asked[-1]["recalibrated"] == ["toy"]  # not lost with the failed exchange
    assert remote.observed_arrivals("toy") is not None
    remote.close()


def test_a_status_crosses_the_wire_whole() -> None:
    stage = StageStatus(
        "tiny",
        3,
        5,
        2,
        float("inf"),
        "kairos",
        8,
        {"i-1": "active"},
        {"i-1": 1.0},
        0.4,
        Overload(12.0, 100.0, 2, 40.0, 50.0, 5.0, refused_samples=2.0, arrived_samples=80.0),
        reach=0.35,
        reach_samples=812,
    )
    worker = WorkerStatus("i-1", "emu.cpu.large", "127.0.0.1:9", True, False, "", 0.25)
    status = AppStatus("toy", "tiny>large", 100.0, (worker,), (stage,), 4)
    assert status_from_json(json.loads(json.dumps(status_to_json(status)))) == status
    # A field a newer serving process adds is left out, not a TypeError every exchange.
    sent = status_to_json(status)
    sent["stages"][0]["a_later_field"] = 1
    sent["stages"][0]["overload"]["a_later_overload_field"] = 1.0  # and in its overload
    assert status_from_json(sent) == status


def test_the_gear_the_loops_send_with_the_feed_is_the_one_the_serving_loop_serves(
    serving: tuple[ServingLoop, TestClient, dict[str, str]], tmp_path: Path
) -> None:
    from tests.component.test_live_gears import APP, FAST, PLAN, applied

    loop, client, tokens = serving
    applied(loop.store, tmp_path, PLAN.to_document())
    plan = loop.store.get_applied_plan(APP)
    assert plan is not None and loop.gears is not None
    remote = RemoteServing("http://testserver", tokens["admin"], FakeClock(), client=client)
    assert loop.gears(APP) is None
    remote.gears = lambda: {APP: (plan.id, 1)}  # gear 1: the fast option
    assert remote.pull()
    served = loop.gears(APP)
    assert served is not None and served.cascade == FAST.cascade
    remote.gears = dict  # the switcher no longer serves it by gears
    assert remote.pull() and loop.gears(APP) is None


def test_a_restarted_loops_process_keeps_the_gear_the_serving_loop_serves(
    serving: tuple[ServingLoop, TestClient, dict[str, str]], tmp_path: Path
) -> None:
    """A loops process restarted sent no gears at its first exchanges, before its switcher had
    read the store, and the serving process served the app by its spec for a second or two (a
    tester's demo: tiny@0.4 -> medium@0.4 -> large between two stretches of its plan's gear).
    The feed leaves the gears out until the switcher has read the store, which resumes the gear
    the log names even before the app's arrivals come. (A standby loops process, whose switcher
    never runs, sent none at every exchange: the app flapped between its spec's cascade and
    its gear several times a second.)"""
    from controlplane.loops.live_gears import LiveGears
    from tests.component.test_live_gears import APP, FAST, PLAN, applied, switcher

    loop, client, tokens = serving
    store = loop.store
    applied(store, tmp_path, PLAN.to_document())
    plan = store.get_applied_plan(APP)
    assert plan is not None and loop.gears is not None
    before = RemoteServing("http://testserver", tokens["admin"], FakeClock(), client=client)
    before.gears = lambda: {APP: (plan.id, 1)}  # the fast gear, as its switcher logged it
    store.record_decision(
        APP, "gear_switch", "up from gear 0 to 1", {"gear": 1, "previous": 0, "plan_id": plan.id}
    )
    assert before.pull() and loop.gears(APP).cascade == FAST.cascade  # type: ignore[union-attr]

    clock = FakeClock(start_s=50.0)
    remote = RemoteServing("http://testserver", tokens["admin"], clock, client=client)
    view = SimpleNamespace(arrivals=remote.observed_arrivals, statuses=remote.statuses)
    gears: LiveGears = switcher(store, clock, view)  # type: ignore[arg-type]
    remote.gears, remote.gears_known = gears.in_force, gears.refreshed
    for _ in range(3):  # before the switcher's first refresh (as a standby's, every exchange)
        assert before.pull() and remote.pull()
        assert loop.gears(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    gears.refresh()
    assert gears.in_force() == {APP: (plan.id, 1)}
    assert remote.pull() and loop.gears(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    remote.close()


def test_the_tuners_batch_cap_crosses_the_feed_to_the_serving_loop(
    serving: tuple[ServingLoop, TestClient, dict[str, str]],
) -> None:
    # A single-model app sized by its ladder batches as the rung its fleet reaches says: the
    # loops' tuner sends the cap with the gears, and the serving loop's gear hook serves it.
    loop, client, tokens = serving
    assert loop.gears is not None
    remote = RemoteServing("http://testserver", tokens["admin"], FakeClock(), client=client)
    remote.batch_caps = lambda: {"toy": {"tiny": 4}}
    assert remote.pull()
    served = loop.gears("toy")
    assert served is not None and served.max_batch_queries == {"tiny": 4}
    assert served.cascade.models == ("tiny",)
    assert loop.gears("other") is None
    remote.batch_caps = dict  # the stage back on its plan's batch
    assert remote.pull() and loop.gears("toy") is None
    # A cap under one is no cap: the feed is refused whole, as any malformed feed.
    said = client.post(
        "/internal/v1/feed",
        json={"batch_caps": {"toy": {"tiny": 0}}},
        headers={"Authorization": f"Bearer {tokens['admin']}"},
    )
    assert said.status_code == 422 and loop.gears("toy") is None


def test_the_rollout_loop_apart_reads_the_serving_processs_version_figures(
    serving: tuple[ServingLoop, TestClient, dict[str, str]],
) -> None:
    from controlplane.serving.versions import CanaryRoute

    loop, client, tokens = serving
    route = CanaryRoute(3, 1, "tiny", 0.1, False, "tiny@1", "tiny@2")
    for ms in (10.0, 20.0, 30.0):
        loop.versions.answered("toy", route, "tiny@2", ms, labelled=1, correct=1)
    loop.versions.failed("toy", route, "tiny@1")
    remote = RemoteServing("http://testserver", tokens["admin"], FakeClock(), client=client)
    assert remote.versions.figures("toy", 3, 1) == loop.versions.figures("toy", 3, 1)
    assert remote.versions.figures("toy", 3, 1)["tiny@2"].queries == 3
    assert remote.versions.figures("toy", 3, 0) == {}  # another step
    remote.versions.forget("toy")
    assert loop.versions.figures("toy", 3, 1) == {}


def test_a_calibration_pass_reads_each_apps_observations_once(tmp_path: Path) -> None:
    """The calibration reads an app's batch times, API times and CPU figure every tick: against
    a serving process apart, one GET of the app's document per pass (the serving process wrote
    it three times a second per app before), read afresh on the next pass and after a
    recalibration forgot some of its times."""
    gets: list[str] = []
    times = {"tiny": [12.0] * 3}

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST":
            assert path == "/internal/v1/apps/toy/forget-batch-times"
            times.clear()
            return httpx.Response(204)
        gets.append(path.split("/")[4])
        document = {
            "batch_times_ms": [[m, "emu.cpu.large", {"1": t}] for m, t in times.items()],
            "api_times_ms": [0.5],
            "serving_cpu_ms": 0.25,
        }
        return httpx.Response(200, json=document)

    client = httpx.Client(transport=httpx.MockTransport(handle))
    remote = RemoteServing("http://serving:8000", "hp_admin", FakeClock(), client=client)
    observed = remote.observations
    with observed.holding():
        for app in ("toy", "other"):
            assert observed.api_times_ms(app) == [0.5]
            assert observed.serving_cpu_ms(app, 0.0) == 0.25
            assert observed.batch_times_ms(app) == {("tiny", "emu.cpu.large"): {1: [12.0] * 3}}
        assert gets == ["toy", "other"]
        observed.forget_batch_times("toy", "tiny", "emu.cpu.large")
        assert observed.batch_times_ms("toy") == {}  # read again: the times are gone
        assert gets == ["toy", "other", "toy"]
    # Outside a pass (and on the next one) every read is of the serving process's figures now.
    assert observed.api_times_ms("toy") == [0.5] and observed.api_times_ms("toy") == [0.5]
    assert gets[3:] == ["toy", "toy"]

    # The service's calibrator reads in such a pass: one GET per app and tick.
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", FakeClock(), upgrade=True)
    try:
        for name in ("toy", "other"):
            store.create_app(
                {
                    "name": name,
                    "models": [{"name": "tiny", "profiles": str(tmp_path / "none.json")}],
                    "slo": {"latency_ms": 500},
                    "budget_usd_per_hr": 1.0,
                    "instance_types": ["emu.cpu.large"],
                },
                who="test",
            )
        settings = Settings(data_dir=tmp_path, provisioner="fake")
        calibration = build_calibrator(settings, store, remote, AppResolver(tmp_path))  # type: ignore[arg-type]
        del gets[:]
        calibration.tick()
        assert sorted(gets) == ["other", "toy"]
    finally:
        store.close()


def test_a_feed_that_keeps_failing_is_said_again_and_a_refusal_is_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loops process that leads blind said so once and never again: the log says it again
    every minute while the feed fails, and a refusal (the token, the URL) is an error."""
    import logging

    from controlplane.loops import remote_serving

    now = [0.0]
    monkeypatch.setattr(remote_serving.time, "monotonic", lambda: now[0])
    feed = ScriptedFeed()
    feed.down = True
    client = httpx.Client(transport=httpx.MockTransport(feed.handle), base_url="http://serving")
    remote = RemoteServing("http://serving", "hp_admin", FakeClock(), client=client)
    with caplog.at_level(logging.INFO, logger=remote_serving.logger.name):
        for _ in range(5):  # the first failure, then nothing within the minute
            assert not remote.pull()
            now[0] += 10.0
        now[0] += 20.0  # 70 s after the first: said again, with how long
        assert not remote.pull()
        feed.down = False
        assert remote.pull()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "WARNING", "INFO"], said
    assert "(for 70 s: the tuner, the gears and the calibration see no traffic)" in said[1][1]

    refusing = httpx.Client(
        transport=httpx.MockTransport(
            lambda request: httpx.Response(
                401, json={"error": {"code": "unauthorized", "message": "unknown token"}}
            )
        ),
        base_url="http://serving",
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=remote_serving.logger.name):
        assert not RemoteServing("http://serving", "wrong", FakeClock(), client=refusing).pull()
    ((level, message),) = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert level == "ERROR" and "check serving_url and internal_token" in message
    # One line, with the serving process's reason (httpx's text was two, the second a link).
    assert message == (
        "the serving process at http://serving refuses the feed: HTTP 401 Unauthorized: unknown"
        " token (check serving_url and internal_token)"
    )

    # A loops process that stops: the serving process, stopped by the same signal, closes its
    # port first, and a feed that fails then is no outage (every clean stop warned of one).
    stopping = RemoteServing("http://serving", "hp_admin", FakeClock(), client=client)
    feed.down = True
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=remote_serving.logger.name):
        stopping.stopping()
        assert not stopping.pull()
    assert caplog.records == []


def test_a_loops_process_whose_feed_fails_says_so_in_its_health(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loops process that leads while its feed fails said it in its log alone: its
    ``/healthz`` says the feed is down and for how long, and "ok" once it answers again."""
    from controlplane.loops import remote_serving

    now = [100.0]
    monkeypatch.setattr(remote_serving.time, "monotonic", lambda: now[0])
    feed = ScriptedFeed()
    client = httpx.Client(transport=httpx.MockTransport(feed.handle), base_url="http://serving")
    remote = RemoteServing("http://serving", "hp_admin", FakeClock(), client=client)
    settings = Settings(data_dir=tmp_path, provisioner="fake")
    clock = FakeClock()
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    app = create_app(settings, store, clock, serving_feed_down_s=remote.down_for_s)
    with TestClient(app) as api:

        def health() -> tuple[object, object]:
            answer = api.get("/healthz")
            assert answer.status_code == 200
            return answer.json()["serving_feed"], answer.json()["serving_feed_down_s"]

        assert remote.pull() and health() == ("ok", None)
        feed.down = True
        assert not remote.pull()
        now[0] += 42.0
        assert health() == ("down", 42.0)
        feed.down = False
        assert remote.pull() and health() == ("ok", None)
        # A process that serves has no feed: null.
        serving = create_app(settings, store, clock)
        with TestClient(serving) as other:
            assert other.get("/healthz").json()["serving_feed"] is None
    store.close()


def test_a_serving_process_without_the_forget_route_is_no_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loops process upgraded before its serving process asks it to forget the API times (a
    route the older one does not have): its 404 was taken for a refusal of the feed, an error
    logged every tick. It is no outage: nothing is logged, and the feed is not down."""
    import logging

    from controlplane.loops import remote_serving

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no route"}})

    client = httpx.Client(transport=httpx.MockTransport(handle), base_url="http://serving")
    remote = RemoteServing("http://serving", "hp_admin", FakeClock(), client=client)
    with caplog.at_level(logging.INFO, logger=remote_serving.logger.name):
        remote.observations.forget_api_times("toy")
    assert caplog.records == [] and remote.down_for_s() is None
