"""A path with an encoded slash (``%2F``) names nothing: answered 404 before any route or layer.

The server decodes a path before routing, so ``/v1/apps/toy%2Fplans`` was served as
``/v1/apps/toy/plans`` (toy's plans, which the command line then read as an app, with a
traceback) and ``/v2/models/toy%2Fready`` as toy's readiness. No app or model name holds a
``/``: the request is refused in the API's error shape (the Open Inference Protocol's on
``/v2``), on the inference fast path too, which answers in front of FastAPI.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.component.test_api import Api, api, assert_error
from tests.component.test_serving import ApiWorld, api_run, row, world

__all__ = ["api", "world"]  # the fixtures, imported for this module's tests


@pytest.mark.parametrize(
    "path",
    [
        "/v1/apps/toy%2Fplans",
        "/v1/apps/toy%2fplans",
        "/v1/apps/toy%2Fbudget",
        "/v1/apps/toy%2Ffleet",
        "/v1/apps/toy%2Fplans%2F1",
        "/v1/models/toy%2Fversions",
    ],
)
def test_an_encoded_slash_in_a_v1_path_is_a_404_in_the_apis_shape(api: Api, path: str) -> None:
    api.register()
    api.preview()
    error = assert_error(api.call("GET", path), 404, "not_found")
    assert error["field"] is None
    assert path in error["message"] and "%2F" in error["message"]


def test_the_same_path_unencoded_is_served(api: Api) -> None:
    api.register()
    assert api.call("GET", "/v1/apps/toy/budget").status_code == 200
    # An encoded slash in the query string is a value's, not the path's.
    assert api.call("GET", "/v1/apps/toy/plans?note=a%2Fb").status_code == 200


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "PUT", "DELETE"])
def test_every_method_is_refused_alike(api: Api, method: str) -> None:
    api.register()
    response = api.call(method, "/v1/apps/toy%2Fbudget", json={"x": 1})
    assert response.status_code == 404
    if method != "HEAD":
        assert response.json()["error"]["code"] == "not_found"
    assert api.call("GET", "/v1/apps/toy").status_code == 200  # nothing changed or deleted


@pytest.mark.parametrize("path", ["/v2/models/toy%2Fready", "/v2/models/toy%2fversions%2F1"])
def test_an_encoded_slash_under_v2_is_a_404_in_the_protocols_shape(api: Api, path: str) -> None:
    api.register()
    response = api.call("GET", path, "infer")
    assert response.status_code == 404, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert path in body["error"]


def test_an_unauthenticated_request_is_refused_the_same(api: Api) -> None:
    """The path is judged before the token: it names nothing whoever asks."""
    assert_error(api.call("GET", "/v1/apps/toy%2Fplans", scope=None), 404, "not_found")


def _oip_request(rows: list[list[float]]) -> dict[str, Any]:
    data = [value for r in rows for value in r]
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [len(rows), 64], "data": data}]
    }


def test_the_inference_fast_path_does_not_serve_an_encoded_slash(world: ApiWorld) -> None:
    """``/v1/apps/demo%2Finfer`` decodes to demo's inference route, which the fast path (in
    front of FastAPI) would have served."""

    async def body(client: httpx.AsyncClient) -> None:
        v1 = await client.post(
            "/v1/apps/demo%2Finfer", json={"inputs": [row(3, 0.9)]}, headers=world.auth()
        )
        assert v1.status_code == 404, v1.text
        assert v1.json()["error"]["code"] == "not_found"
        v2 = await client.post(
            "/v2/models/demo%2Finfer", json=_oip_request([row(3, 0.9)]), headers=world.auth()
        )
        assert v2.status_code == 404, v2.text
        assert isinstance(v2.json()["error"], str)

    api_run(world, body)
    assert world.app.state.services.requests.snapshot().get(("demo", 200)) is None
    assert "demo" not in world.serving.observations.totals()
