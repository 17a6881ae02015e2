"""The inference request's fast path (``controlplane.api.fast_infer``) against the route it
stands in for: the same answers, the same errors, every unusual request handed to the route, a
revoked token refused at once. The API, the store and the serving loop are real; the workers are
the fake ones of ``test_serving``.

The fast path is the one that answers when the store's ``verify_token`` (the route's token
check, which reads the database) is not called for the request: it reads the token cache, and
verifies a token (once, however many requests wait for it) only when no answer is cached.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.api.fast_infer import MAX_PENDING_CHECKS, TokenCheck, plain_body
from controlplane.db.store import Principal
from controlplane.errors import OverloadedError
from tests.component.test_serving import (
    LARGE,
    SMALL,
    ApiWorld,
    api_run,
    endpoints,
    fleet,
    row,
)

URL = "/v1/apps/demo/infer"
OIP_URL = "/v2/models/demo/infer"
OIP_VERSIONED = "/v2/models/demo/versions/1/infer"  # not the fast path's: the route's


@pytest.fixture
def world(tmp_path: Path) -> Iterator[ApiWorld]:
    # An SLO no cold start reaches: a first request's own path (imports, the app's first
    # resolve) took 340 ms on a busy machine, and admission refused the part a cascade forwards
    # against 300 ms; these tests are of the route and the fast path answering alike.
    made = ApiWorld(tmp_path, slo_ms=10_000.0)
    yield made
    made.store.close()


class _Checks:
    """Counts the store's full token checks (the route's path)."""

    def __init__(self, world: ApiWorld) -> None:
        self.count = 0
        verify = world.store.verify_token

        def counted(token: str, **kwargs: Any) -> Any:
            self.count += 1
            return verify(token, **kwargs)

        world.store.verify_token = counted  # type: ignore[method-assign]


def _answer_fields(answer: dict[str, Any]) -> tuple[Any, ...]:
    # "late" is left out: it says whether this query's own time passed its target, which a
    # loaded machine decides differently for two identical queries; its type is checked instead.
    assert isinstance(answer["late"], bool)
    return answer["outputs"], answer["models"], answer["certainty"], answer["gear"]


def test_the_fast_path_answers_as_the_route_does(world: ApiWorld) -> None:
    checks = _Checks(world)
    payload = {"inputs": [row(3, 0.9), row(4, 0.1)], "sample_ids": [10, 11]}

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        first = await client.post(URL, json=payload, headers=world.auth())
        assert first.status_code == 200, first.text
        assert checks.count == 1  # the token was checked (and cached)
        second = await client.post(URL, json=payload, headers=world.auth())
        assert second.status_code == 200, second.text
        assert checks.count == 1  # answered without the route's check: the fast path
        assert set(second.json()) == set(first.json())
        assert set(second.json()["timings"]) == set(first.json()["timings"])
        assert _answer_fields(second.json()) == _answer_fields(first.json())
        assert second.headers["content-type"] == "application/json"

    api_run(world, body)
    counts = world.app.state.services.requests.snapshot()
    assert counts[("demo", 200)] == 2
    assert world.serving.observations.totals()["demo"].answered == 2


def test_the_fast_path_answers_in_front_of_fastapis_own_layers(world: ApiWorld) -> None:
    """The fast path sits in front of FastAPI (ServiceApp's front): a query it answers never
    enters FastAPI's middleware stack (its server error handler, telemetry and body limit);
    what it hands on goes the whole way, as every other request does."""
    entered: list[str] = []

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([LARGE])))
        app = world.app
        stack = app.middleware_stack or app.build_middleware_stack()

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            entered.append(scope["path"])
            await stack(scope, receive, send)

        app.middleware_stack = counted
        answer = await client.post(URL, json={"inputs": [row(1, 0.9)]}, headers=world.auth())
        assert answer.status_code == 200, answer.text
        oip = await client.post(OIP_URL, json=_oip_request([row(2, 0.9)]), headers=world.auth())
        assert oip.status_code == 200, oip.text
        assert entered == []
        routed = await client.post(
            URL, json={"inputs": [row(1, 0.5)], "extra": 1}, headers=world.auth()
        )
        assert routed.status_code == 422, routed.text  # the route's answer, through FastAPI
        assert (await client.get("/healthz")).status_code == 200
        assert entered == [URL, "/healthz"]

    api_run(world, body)


@pytest.mark.parametrize(
    ("payload", "status", "field"),
    [
        ({"inputs": [row(1, 0.5)], "requirements": {"latency_ms": 250}}, 200, None),
        ({"inputs": [[True] * 64]}, 422, "inputs[0][0]"),
        ({"inputs": [[*row(1, 0.5), 1.0]]}, 422, "inputs[0]"),
        ({"inputs": [row(1, 0.5)], "extra": 1}, 422, "extra"),
        ({"inputs": []}, 422, "inputs"),
        ({"inputs": [row(1, 0.5)], "sample_ids": [1, 2]}, 422, "sample_ids"),
        ({"inputs": [[99.0] * 64]}, 422, "inputs[0][0]"),
    ],
)
def test_what_the_fast_path_does_not_take_gets_the_routes_answer(
    world: ApiWorld, payload: dict[str, Any], status: int, field: str | None
) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        warm = await client.post(URL, json={"inputs": [row(2, 0.9)]}, headers=world.auth())
        assert warm.status_code == 200, warm.text  # the token is cached from here on
        response = await client.post(URL, json=payload, headers=world.auth())
        assert response.status_code == status, response.text
        if status != 200:
            assert response.json()["error"]["field"] == field

    api_run(world, body)


def test_too_many_rows_are_refused_by_their_count_not_their_contents(world: ApiWorld) -> None:
    """300 rows where 256 are taken: the message says how many (it quoted the rows too)."""

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        response = await client.post(
            URL, json={"inputs": [row(1, 0.5)] * 300}, headers=world.auth()
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "inputs" and "not 300" in error["message"], error
        assert "got" not in error["message"] and "[" not in error["message"], error

    api_run(world, body)


def test_tokens_apps_and_bodies_the_fast_path_refuses_as_the_route_does(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        ok = {"inputs": [row(2, 0.9)]}
        assert (await client.post(URL, json=ok, headers=world.auth())).status_code == 200
        assert (await client.post(URL, json=ok)).status_code == 401
        viewer = await client.post(URL, json=ok, headers=world.auth("viewer"))
        assert viewer.status_code == 403
        unknown = await client.post("/v1/apps/nope/infer", json=ok, headers=world.auth())
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        bad_json = await client.post(
            URL, content=b"{", headers={**world.auth(), "Content-Type": "application/json"}
        )
        assert bad_json.status_code == 400
        # A revoked token is refused on the very next request, cached or not.
        world.store.revoke_token("infer-token")
        revoked = await client.post(URL, json=ok, headers=world.auth())
        assert revoked.status_code == 401

    api_run(world, body)


def test_concurrent_requests_with_an_uncached_token_share_one_check(world: ApiWorld) -> None:
    checks = _Checks(world)
    ok = {"inputs": [row(2, 0.9)]}

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        answers = await asyncio.gather(
            *(client.post(URL, json=ok, headers=world.auth()) for _ in range(8))
        )
        assert [a.status_code for a in answers] == [200] * 8
        # One database read for the eight (shared, or cached by the time a request asked):
        # none of them took the route's own check.
        assert checks.count == 1

    api_run(world, body)


def test_no_serving_instance_is_the_routes_503(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", [])
        ok = {"inputs": [row(2, 0.9)]}
        first = await client.post(URL, json=ok, headers=world.auth())
        second = await client.post(URL, json=ok, headers=world.auth())  # the fast path
        assert first.status_code == second.status_code == 503
        assert first.json() == second.json()

    api_run(world, body)


def test_a_models_nan_is_a_502_not_a_class_on_both_paths(world: ApiWorld) -> None:
    """A model answering NaN logits was answered as class 0 with a null certainty on /v1."""

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL, LARGE])
        for worker in workers:
            worker.non_finite = lambda _model, _row: True  # NaN, Infinity, -Infinity, ...
        world.instances.set("demo", endpoints(workers))
        ok = {"inputs": [row(2, 0.9)]}
        first = await client.post(URL, json=ok, headers=world.auth())  # the route
        second = await client.post(URL, json=ok, headers=world.auth())  # the fast path
        assert first.status_code == second.status_code == 502, first.text
        assert first.json() == second.json()
        assert "not finite" in first.json()["error"]["message"]

    api_run(world, body)


def _oip_request(rows: list[list[float]]) -> dict[str, Any]:
    data = [value for r in rows for value in r]
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [len(rows), 64], "data": data}]
    }


def test_the_open_inference_protocol_takes_the_fast_path_too(world: ApiWorld) -> None:
    checks = _Checks(world)
    payload = _oip_request([row(3, 0.9), row(4, 0.1)])
    pixels = np.array([row(6, 0.9)], dtype=np.float32)
    head = json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
                     "parameters": {"binary_data_size": pixels.nbytes}}]}
    ).encode()  # fmt: skip

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", [])
        # No worker: the serving's 503, in the protocol's shape, as the route answers it.
        fast = await client.post(OIP_URL, json=payload, headers=world.auth())
        route = await client.post(OIP_VERSIONED, json=payload, headers=world.auth())
        assert fast.status_code == route.status_code == 503
        assert fast.json() == route.json() and isinstance(fast.json()["error"], str)
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        checks.count = 0
        first = await client.post(OIP_URL, json=payload, headers=world.auth())
        assert first.status_code == 200, first.text
        binary = await client.post(
            OIP_URL,
            content=head + pixels.tobytes(),
            headers={**world.auth(), "Inference-Header-Content-Length": str(len(head))},
        )
        assert binary.status_code == 200, binary.text
        assert checks.count == 0  # no request took the route's token check: the fast path
        route = await client.post(OIP_VERSIONED, json=payload, headers=world.auth())
        assert checks.count == 1  # the versioned path is the route's
        assert first.json()["outputs"] == route.json()["outputs"]
        assert set(first.json()["parameters"]) == set(route.json()["parameters"])
        assert np.argmax(binary.json()["outputs"][0]["data"]) == 6
        # A query the protocol refuses goes to the route, which names the field.
        wrong = _oip_request([row(1, 0.5)])
        wrong["inputs"][0]["shape"] = [1, 63]
        refused = await client.post(OIP_URL, json=wrong, headers=world.auth())
        assert refused.status_code == 400 and "shape" in refused.json()["error"]

    api_run(world, body)


# A JSON type the fast path hands on (it takes application/json only) and FastAPI reads as JSON:
# the same request answered the route's way.
ROUTE_JSON = "application/vnd.heteroplane+json"


def _refusal(response: httpx.Response) -> tuple[Any, ...]:
    """What a 429 of admission says but its figures (the predicted time, Retry-After's seconds):
    its header names, its body's keys, its code, field and message up to the figures."""
    assert int(response.headers["retry-after"]) >= 1
    assert int(response.headers["content-length"]) == len(response.content)
    error = response.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith("app 'demo' is overloaded: a new query would take about"), message
    fields = (
        None if isinstance(error, str) else (tuple(sorted(error)), error["code"], error["field"])
    )
    names = tuple(sorted(response.headers))
    return names, response.headers["content-type"], tuple(sorted(response.json())), fields


def test_admissions_refusal_is_the_routes_429_on_both_protocols(tmp_path: Path) -> None:
    """Past saturation most answers are admission's refusals, which the fast path writes itself
    (send_overloaded): the route's status, headers and body, in each protocol's shape, counted."""
    world = ApiWorld(tmp_path, fixed_ms=20.0)  # tiny takes 20 ms a batch, the SLO 300 ms
    checks = _Checks(world)
    v1 = json.dumps({"inputs": [row(1, 0.9)]}).encode()
    v2 = json.dumps(_oip_request([row(1, 0.9)])).encode()
    counted = world.app.state.services.requests

    async def burst(
        client: httpx.AsyncClient, url: str, payload: bytes, content_type: str
    ) -> list[httpx.Response]:
        headers = {**world.auth(), "Content-Type": content_type}
        return list(
            await asyncio.gather(
                *(client.post(url, content=payload, headers=headers) for _ in range(60))
            )
        )

    async def body(client: httpx.AsyncClient) -> dict[str, list[httpx.Response]]:
        world.instances.set("demo", endpoints(await fleet([LARGE], delay_s=0.02)))
        warm = await client.post(
            URL, content=v1, headers={**world.auth(), "Content-Type": "application/json"}
        )
        assert warm.status_code == 200, warm.text  # the token is cached from here on
        checks.count = 0
        answers: dict[str, list[httpx.Response]] = {}
        for name, url, payload, content_type, fast in (
            ("/v1 fast path", URL, v1, "application/json", True),
            ("/v1 route", URL, v1, ROUTE_JSON, False),
            ("/v2 fast path", OIP_URL, v2, "application/json", True),
            ("/v2 route", OIP_VERSIONED, v2, "application/json", False),
        ):
            before = counted.snapshot().get(("demo", 429), 0)
            answers[name] = await burst(client, url, payload, content_type)
            refused = sum(1 for r in answers[name] if r.status_code == 429)
            if fast:
                assert checks.count == 0, name  # no route's token check: the fast path answered
                assert counted.snapshot().get(("demo", 429), 0) - before == refused, name
            checks.count = 0
        return answers

    try:
        answers = api_run(world, body)
    finally:
        world.store.close()
    shapes = {}
    for name, responses in answers.items():
        assert {r.status_code for r in responses} <= {200, 429}, name
        refused = [r for r in responses if r.status_code == 429]
        assert refused, f"{name}: no query was refused"
        seen = {_refusal(r) for r in refused}
        assert len(seen) == 1, (name, seen)
        shapes[name] = seen.pop()
    assert shapes["/v1 fast path"] == shapes["/v1 route"]
    assert shapes["/v2 fast path"] == shapes["/v2 route"]
    assert shapes["/v1 fast path"][3] == (("code", "field", "message"), "overloaded", None)
    assert shapes["/v2 fast path"][3] is None  # the protocol's {"error": "..."}


def test_a_body_without_requirements_is_judged_again_by_the_gears_before_it_is_parsed(
    world: ApiWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where only a variant a model-less query may be given would admit a query (the serving
    loop's early check says to ask again once the body is read), a ``/v1`` body that holds no
    ``requirements`` is judged again by the gears alone (``plain``) and refused (429) before it
    is parsed, a malformed one too; one that holds them goes on to the route, which serves it
    at its variant."""
    asked: list[bool] = []

    def refuse_early(app: str, received_s: float | None = None, *, plain: bool = False) -> bool:
        asked.append(plain)
        if plain:
            raise OverloadedError(app, predicted_ms=900.0, slo_ms=300.0, retry_after_s=1)
        return True

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        monkeypatch.setattr(world.serving, "refuse_early", refuse_early)
        headers = {**world.auth(), "Content-Type": "application/json"}
        malformed = await client.post(URL, content=b"{not json", headers=headers)
        needs = {"latency_ms": 60_000.0}
        model_less = await client.post(
            URL, json={"inputs": [row(3, 0.9)], "requirements": needs}, headers=world.auth()
        )
        return malformed, model_less

    malformed, model_less = api_run(world, body)
    assert malformed.status_code == 429, malformed.text
    assert malformed.json()["error"]["code"] == "overloaded"
    assert model_less.status_code == 200, model_less.text
    assert model_less.json()["outputs"] == [3]
    assert asked == [False, True, False]


def test_plain_bodies() -> None:
    assert plain_body({"inputs": [[1, 2.5]]}) == ([[1, 2.5]], None)
    assert plain_body({"inputs": [[1]], "sample_ids": [0]}) == ([[1]], [0])
    refused: Any
    for refused in (
        [],
        {"inputs": [[1]], "requirements": {}},
        {"inputs": [[float("nan")]]},
        {"inputs": [["1"]]},
        {"inputs": [[]]},
        {"inputs": [[1]], "sample_ids": [-1]},
        {"inputs": [[1]], "sample_ids": [2**31]},
        {"inputs": [[1]], "sample_ids": [True]},
        {"inputs": [[1]] * 257},
    ):
        assert plain_body(refused) is None, refused


# --- the token check on its own (a stand-in store) --------------------------------------------


class _Store:
    """``cached_token`` answers what the test set (or what the last check cached);
    ``verify_token`` counts its calls, holds each until ``release`` (or raises ``error``), and
    caches its answer unless ``revoked_while_reading`` (as the store does when a revocation
    comes during the read)."""

    def __init__(self, cached: tuple[Principal | None, bool]) -> None:
        self.cached = cached
        self.calls = 0
        self.release = threading.Event()
        self.error: Exception | None = None
        self.revoked_while_reading = False

    def cached_token(self, token: str) -> tuple[Principal | None, bool]:
        return self.cached

    def cached_principal(self, token: str) -> Principal | None:
        return self.cached[0]

    def verify_token(self, token: str, *, fresh: bool = False) -> Principal | None:
        assert fresh
        self.calls += 1
        self.release.wait(timeout=30)
        if self.error is not None:
            raise self.error
        if not self.revoked_while_reading:
            self.cached = (PRINCIPAL, False)
        return PRINCIPAL  # what it read


PRINCIPAL = Principal("client", "infer")


def test_a_cached_token_not_due_is_answered_without_a_check() -> None:
    store = _Store((PRINCIPAL, False))
    assert asyncio.run(TokenCheck(store).principal("hp_x")) == PRINCIPAL
    assert store.calls == 0


def test_a_token_due_is_checked_again_in_the_background_once() -> None:
    store = _Store((PRINCIPAL, True))

    async def scenario() -> None:
        check = TokenCheck(store)
        # Answered from the cache at once, the check still held in its thread.
        assert await check.principal("hp_x") == PRINCIPAL
        assert await check.principal("hp_x") == PRINCIPAL
        pending = check._pending["hp_x"]
        store.release.set()
        assert await pending == PRINCIPAL
        assert store.calls == 1 and "hp_x" not in check._pending

    asyncio.run(scenario())


def test_waiters_for_an_uncached_token_share_its_check_and_its_failure() -> None:
    store = _Store((None, True))

    async def scenario() -> None:
        check = TokenCheck(store)
        # Five requests in one turn of the loop: the check's answer cannot come back before
        # all of them have asked (it reaches the loop as a callback of a later turn).
        waiting = [asyncio.ensure_future(check.principal("hp_x")) for _ in range(5)]
        store.release.set()
        assert await asyncio.gather(*waiting) == [PRINCIPAL] * 5
        assert store.calls == 1
        # A store that cannot answer: None (the route reads it again and answers the error).
        store.cached = (None, True)
        store.error = RuntimeError("database is down")
        assert await check.principal("hp_x") is None
        assert store.calls == 2 and not check._pending

    asyncio.run(scenario())


def test_a_revocation_while_the_check_reads_is_not_let_through() -> None:
    """The check read the token as valid, then it was revoked (so the store did not cache that
    read): a request waiting on the check gets None, and the route reads the store again."""
    store = _Store((None, True))
    store.revoked_while_reading = True
    store.release.set()
    assert asyncio.run(TokenCheck(store).principal("hp_x")) is None
    assert store.calls == 1


def test_past_the_pending_checks_an_uncached_token_goes_to_the_route() -> None:
    store = _Store((None, True))

    async def scenario() -> None:
        check = TokenCheck(store)
        waiting = [check._verify(f"hp_{i}") for i in range(MAX_PENDING_CHECKS)]
        assert len(check._pending) == MAX_PENDING_CHECKS
        assert await check.principal("hp_one_more") is None  # no check started for it
        assert "hp_one_more" not in check._pending
        store.release.set()
        await asyncio.gather(*waiting)
        assert store.calls == MAX_PENDING_CHECKS and not check._pending

    asyncio.run(scenario())
