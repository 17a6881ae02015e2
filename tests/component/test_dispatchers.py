"""One dispatcher per app among several serving processes (docs/service.md, "Several serving
processes"): the dispatch leases in a real (SQLite) database through the store and
:class:`DispatchOwners`, on a fake clock; and :class:`ForwardingMiddleware` between two ASGI
apps, the forwarding one reaching the other through a real loopback HTTP server."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controlplane.api.forwarding import FORWARDED_HEADER, Forwarder, ForwardingMiddleware
from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import Store
from controlplane.serving.owners import DispatchOwners
from tests.component.test_store import spec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'heteroplane.db'}"
    migrate.upgrade(url)
    found = Store.from_url(url, clock)
    yield found
    found.close()


def test_each_app_has_one_dispatcher_until_its_lease_ends(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("one"), who="test")
    first = DispatchOwners(store, clock, "http://a:1", lease_s=10.0, renew_s=2.0)
    second = DispatchOwners(store, clock, "http://b:2", lease_s=10.0, renew_s=2.0)
    first.hold()
    second.hold()
    assert first.owns("one") and not second.owns("one")
    assert first.forward_to("one") is None and second.forward_to("one") == "http://a:1"

    # A new app goes to whoever holds first; the other forwards it.
    store.create_app(spec("two"), who="test")
    second.hold()
    first.hold()
    assert second.owns("two") and first.forward_to("two") == "http://b:2"

    # The first stops renewing: once its lease has ended the second takes its app, and until
    # the second's round the first's reading of it has lapsed (served where it lands).
    clock.advance(10.0)
    assert second.forward_to("one") is None
    second.hold()
    assert second.owns("one") and second.owns("two")
    first.hold()
    assert first.forward_to("one") == "http://b:2"

    # A serving process that stops gives its apps up: the next round of another takes them.
    second.close()
    first.hold()
    assert first.owns("one") and first.owns("two")


def _serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            pytest.fail("the dispatcher did not start")
        thread.join(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def _app(name: str, seen: list[tuple[str, str, bytes, str | None]]) -> Starlette:
    async def infer(request: Request) -> Response:
        body = await request.body()
        seen.append((name, request.url.path, body, request.headers.get("authorization")))
        return JSONResponse({"served_by": name}, status_code=200 if body != b"bad" else 422)

    async def other(_request: Request) -> Response:
        return JSONResponse({"served_by": name})

    return Starlette(
        routes=[
            Route("/v1/apps/{app}/infer", infer, methods=["POST"]),
            Route("/v2/models/{app}/infer", infer, methods=["POST"]),
            Route("/v1/apps", other, methods=["GET", "POST"]),
        ]
    )


class Owners:
    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def forward_to(self, app: str) -> str | None:
        return self.table.get(app)


class Tokens:
    """The tokens this process knows: ``hp_x`` only; the ones it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def principal(self, token: str) -> str | None:
        self.asked.append(token)
        return "ops" if token == "hp_x" else None


def test_a_process_takes_leases_only_once_it_answers_at_its_url(
    store: Store, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A dispatch_url that reaches nobody or another process made a dispatcher the others could
    not forward to (they served its apps themselves: two matchers on one fleet); a process now
    takes leases only once its URL answers with its own id, and says why not meanwhile."""
    import logging

    store.create_app(spec("one"), who="test")
    answers: dict[str, str | None] = {"http://a:1": None}
    misdirected = DispatchOwners(store, clock, "http://a:1", probe=answers.get)
    other = DispatchOwners(store, clock, "http://b:2", probe=answers.get)
    misdirected.start()  # the start's round does not probe: nothing taken
    misdirected.close()
    assert not misdirected.owns("one") and misdirected.forward_to("one") is None
    with caplog.at_level(logging.WARNING, logger="controlplane.serving.owners"):
        misdirected.hold()  # nobody answers there: nothing taken, said once
        misdirected.hold()
        answers["http://a:1"] = other.owner  # its URL reaches the other process
        misdirected.hold()
        misdirected.hold()
    assert not misdirected.owns("one") and not misdirected.reachable
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "ERROR"], said
    assert "nothing answers at http://a:1" in said[0][1]
    assert "http://a:1 reaches another serving process" in said[1][1]
    answers["http://b:2"] = other.owner
    other.hold()  # the other answers at its own URL: it dispatches, the first forwards to it
    assert other.owns("one") and misdirected.forward_to("one") is None  # not read yet
    misdirected.hold()
    assert misdirected.forward_to("one") == "http://b:2"


def test_the_queries_of_an_app_dispatched_elsewhere_are_answered_there() -> None:
    seen: list[tuple[str, str, bytes, str | None]] = []
    url, server, thread = _serve(_app("owner", seen))
    owners = Owners({"theirs": url, "gone": "http://127.0.0.1:9"})
    tokens = Tokens()
    forwarder = Forwarder(owners, body_max_bytes=1024, tokens=tokens)
    here = ForwardingMiddleware(_app("here", seen), forwarder)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=here)
        async with httpx.AsyncClient(transport=transport, base_url="http://here") as client:
            auth = {"Authorization": "Bearer hp_x"}
            answers = [
                await client.post("/v1/apps/theirs/infer", content=b"q1", headers=auth),
                await client.post("/v2/models/theirs/infer", content=b"q2", headers=auth),
                await client.post("/v1/apps/theirs/infer", content=b"bad", headers=auth),
                await client.post("/v1/apps/mine/infer", content=b"q3", headers=auth),
                await client.post("/v1/apps", content=b"q4"),
                # Forwarded already: served where it lands.
                await client.post(
                    "/v1/apps/theirs/infer", content=b"q5", headers={FORWARDED_HEADER: "1"}
                ),
                # Longer than the limit: served here, where the limits answer it.
                await client.post("/v1/apps/theirs/infer", content=b"x" * 2000),
                # Its dispatcher does not answer: served here.
                await client.post("/v1/apps/gone/infer", content=b"q6"),
            ]
        await forwarder.aclose()
        return answers

    try:
        answers = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join()
    assert [a.json()["served_by"] for a in answers] == [
        "owner",
        "owner",
        "owner",
        "here",
        "here",
        "here",
        "here",
        "here",
    ]
    assert answers[2].status_code == 422  # the dispatcher's answer, as it is
    forwarded = [(path, body, auth) for name, path, body, auth in seen if name == "owner"]
    assert forwarded == [
        ("/v1/apps/theirs/infer", b"q1", "Bearer hp_x"),
        ("/v2/models/theirs/infer", b"q2", "Bearer hp_x"),
        ("/v1/apps/theirs/infer", b"bad", "Bearer hp_x"),
    ]
    assert [body for name, _, body, _ in seen if name == "here"][-1] == b"q6"
    # The token of each request forwarded (or meant to be) was checked here, for the connection.
    assert tokens.asked == ["hp_x", "hp_x", "hp_x"]
