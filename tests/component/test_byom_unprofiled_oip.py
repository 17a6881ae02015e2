"""An app of registered models that has not been profiled yet on the Open Inference Protocol
(:mod:`controlplane.api.routes.oip`, :mod:`controlplane.api.grpc_oip`): its metadata is the
registry's signature (200), its readiness a 503 that says what to run (gRPC: ``ready`` false),
as docs/api.md says; an unknown app stays a 404."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controlplane.api.grpc_oip import attach
from controlplane.spec import UnprofiledModelError
from provisioners.artifacts import ModelSignature, TensorSpec
from tests.component.test_oip_routes import _WithArtifacts, live_server
from tests.component.test_serving import LARGE, SMALL, ApiWorld, api_run, world

__all__ = ["world"]  # the fixture, imported for this module's tests

SIGNATURE = ModelSignature(
    (TensorSpec("ids", "INT64", (-1, 3)),), (TensorSpec("scores", "FP32", (-1, 4)),)
)
METADATA = {
    "name": "demo",
    "versions": ["1"],
    "platform": "heteroplane",
    "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1, 3]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}],
}


class _Unprofiled(_WithArtifacts):
    """A resolved app of registry models whose latency profiles are not measured yet."""

    def profile(self, model: str, instance_type: str) -> Any:
        raise UnprofiledModelError(self.spec.name, model, [])


class _UnprofiledResolver:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def resolve(self, *args: Any, **kwargs: Any) -> Any:
        return _Unprofiled(self.inner.resolve(*args, **kwargs), SIGNATURE)

    def __getattr__(self, name: str) -> Any:  # the rest of the resolver (its generation)
        return getattr(self.inner, name)


def unprofiled(world: ApiWorld) -> None:
    world.serving.resolver = _UnprofiledResolver(world.serving.resolver)  # type: ignore[assignment]


def test_rest_metadata_and_readiness_of_an_app_not_profiled_yet(world: ApiWorld) -> None:
    unprofiled(world)

    async def body(client: httpx.AsyncClient) -> None:
        for path in ("/v2/models/demo", "/v2/models/demo/versions/1"):
            response = await client.get(path, headers=world.auth())
            assert (response.status_code, response.json()) == (200, METADATA), path
        for path in ("/v2/models/demo/ready", "/v2/models/demo/versions/1/ready"):
            response = await client.get(path, headers=world.auth())
            assert response.status_code == 503, (path, response.text)
            assert response.json() == {
                "error": "app demo has no latency profiles for model tiny yet: run heteroplane"
                " profile run --app demo"
            }
        # A query is refused as the readiness is: 503, in each route's error shape.
        query = {
            "inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}]
        }
        response = await client.post("/v2/models/demo/infer", json=query, headers=world.auth())
        assert response.status_code == 503, response.text
        assert "no latency profiles for model tiny yet" in response.json()["error"]
        response = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [[1, 2, 3]]}, headers=world.auth()
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "serving_unavailable"
        for path in ("/v2/models/nope", "/v2/models/nope/ready"):
            response = await client.get(path, headers=world.auth())
            assert response.status_code == 404 and "no model 'nope'" in response.json()["error"]

    api_run(world, body)


grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture
def served(world: ApiWorld) -> Iterator[tuple[ApiWorld, str]]:
    unprofiled(world)
    listener = attach(world.app, "127.0.0.1", 0, world.settings.oip_body_max_bytes)
    with live_server(world, [SMALL, LARGE]):
        yield world, f"127.0.0.1:{listener.port}"


def test_grpc_metadata_and_readiness_of_an_app_not_profiled_yet(
    served: tuple[ApiWorld, str],
) -> None:
    world, address = served
    headers = {"authorization": f"Bearer {world.tokens['infer']}"}
    client = grpcclient.InferenceServerClient(address)
    try:
        assert client.is_model_ready("demo", headers=headers) is False
        assert client.is_model_ready("demo", "1", headers=headers) is False
        metadata = client.get_model_metadata("demo", headers=headers, as_json=True)
        assert metadata["inputs"] == [{"name": "ids", "datatype": "INT64", "shape": ["-1", "3"]}]
        assert metadata["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": ["-1", "4"]}]
    finally:
        client.close()
