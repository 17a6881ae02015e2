"""The control plane's Open Inference Protocol v2 routes (:mod:`controlplane.api.routes.oip`)
over the serving loop and fake workers speaking v2 (:mod:`tests.fake_worker`):
health without a token, metadata and readiness, inference with JSON tensors and with Triton's
binary tensor extension (read back with ``tritonclient``'s own parser), a 400 naming the field
for a request that does not fit the app's signature, 401/403 without an infer token, an app of
models brought to the registry (several inputs, integer and boolean datatypes) on ``/v2`` and on
``/v1``; and ``tritonclient.http.InferenceServerClient`` against a real uvicorn server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn

from controlplane import __version__
from controlplane.cli.serve import listen
from controlplane.service.protocol import server_options
from provisioners.artifacts import ModelSignature, TensorSpec
from tests.component.test_serving import (
    LARGE,
    SMALL,
    ApiWorld,
    api_run,
    endpoints,
    fleet,
    row,
    world,
)
from tests.fake_worker import FakeWorker

__all__ = ["world"]  # the fixture, imported for this module's tests

TWO_INPUTS = ModelSignature(
    (TensorSpec("ids", "INT64", (-1, 3)), TensorSpec("mask", "BOOL", (-1, 3))),
    (TensorSpec("scores", "FP32", (-1, 4)), TensorSpec("label", "INT64", (-1,))),
)
ONE_INT_INPUT = ModelSignature(
    (TensorSpec("ids", "INT64", (-1, 2, 2)),), (TensorSpec("scores", "FP32", (-1, 3)),)
)


class _WithArtifacts:
    """A resolved app whose models are artifacts of ``signature`` (what the resolver's
    ``artifacts`` gives once an app names registry models)."""

    def __init__(self, resolved: Any, signature: ModelSignature) -> None:
        self._resolved = resolved
        self.artifacts = {
            m: SimpleNamespace(signature=signature, certainty="max_prob", size_bytes=None)
            for m in resolved.spec.serving_order
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolved, name)


class _ArtifactResolver:
    def __init__(self, inner: Any, signature: ModelSignature) -> None:
        self.inner = inner
        self.signature = signature

    def resolve(self, *args: Any, **kwargs: Any) -> Any:
        return _WithArtifacts(self.inner.resolve(*args, **kwargs), self.signature)

    def __getattr__(self, name: str) -> Any:  # the rest of the resolver (its generation)
        return getattr(self.inner, name)


def as_artifacts(world: ApiWorld, signature: ModelSignature) -> None:
    world.serving.resolver = _ArtifactResolver(world.serving.resolver, signature)  # type: ignore[assignment]


def tensor(name: str, datatype: str, array: np.ndarray) -> dict[str, Any]:
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "data": array.ravel().tolist(),
    }


def family_request(rows: list[list[float]], **extra: Any) -> dict[str, Any]:
    return {"inputs": [tensor("input", "FP32", np.array(rows, dtype=np.float32))], **extra}


def test_health_metadata_readiness_and_tokens(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        for path, key in (("/v2/health/live", "live"), ("/v2/health/ready", "ready")):
            response = await client.get(path)
            assert (response.status_code, response.json()) == (200, {key: True})
        # The server's metadata (tritonclient's get_server_metadata), without a token too.
        server = await client.get("/v2")
        assert server.status_code == 200, server.text
        assert server.json() == {"name": "heteroplane", "version": __version__, "extensions": []}
        response = await client.get("/v2/models/demo", headers=world.auth())
        assert response.status_code == 200, response.text
        assert response.json() == {
            "name": "demo",
            "versions": ["1"],
            "platform": "heteroplane",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
        }
        response = await client.get("/v2/models/demo/versions/1", headers=world.auth())
        assert response.json()["name"] == "demo"
        response = await client.get("/v2/models/demo/versions/2", headers=world.auth())
        assert response.status_code == 404 and "version '2'" in response.json()["error"]
        response = await client.get("/v2/models/nope", headers=world.auth())
        assert response.status_code == 404
        assert isinstance(response.json()["error"], str)  # the protocol's error body
        # Not ready without a worker; ready once the fleet has them.
        response = await client.get("/v2/models/demo/ready", headers=world.auth())
        assert response.status_code == 503 and "no running worker" in response.json()["error"]
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        response = await client.get("/v2/models/demo/ready", headers=world.auth())
        assert (response.status_code, response.json()) == (200, {"name": "demo", "ready": True})
        payload = family_request([row(1, 0.9)])
        for path in ("/v2/models/demo", "/v2/models/demo/ready", "/v2/models/demo/infer"):
            method = "POST" if path.endswith("infer") else "GET"
            response = await client.request(method, path, json=payload)
            assert response.status_code == 401, path
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"].startswith("an API token is required")
            response = await client.request(
                method, path, json=payload, headers=world.auth("viewer")
            )
            assert response.status_code == 403, path
            assert "this needs infer" in response.json()["error"]

    api_run(world, body)


def test_json_inference_answers_the_raw_outputs_per_row(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post(
            "/v2/models/demo/infer", json=family_request([row(1, 0.9)]), headers=world.auth()
        )
        assert response.status_code == 503, response.text  # no worker yet
        assert "no running worker" in response.json()["error"]
        workers = await fleet([SMALL, LARGE])
        world.instances.set("demo", endpoints(workers))
        rows = [row(3, 0.9), row(4, 0.1), row(5, 0.7)]
        response = await client.post(
            "/v2/models/demo/infer",
            json=family_request(rows, id="req-1"),
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        assert "inference-header-content-length" not in response.headers
        answer = response.json()
        assert (answer["model_name"], answer["model_version"], answer["id"]) == (
            "demo",
            "1",
            "req-1",
        )
        (output,) = answer["outputs"]
        assert (output["name"], output["datatype"], output["shape"]) == ("logits", "FP32", [3, 10])
        values = np.array(output["data"]).reshape(3, 10)
        assert values.argmax(axis=1).tolist() == [3, 4, 5]
        parameters = answer["parameters"]
        assert parameters["models"] == ["tiny", "large", "tiny"]  # 0.1 is forwarded
        assert parameters["gear"] == "tiny@0.5 -> large" and isinstance(parameters["late"], bool)
        assert parameters["total_ms"] >= parameters["service_ms"] >= 0.0
        # The worker got the rows as one flat FP32 tensor per batch.
        sent = workers[0].last_request or workers[1].last_request
        assert sent is not None and sent["inputs"][0]["name"] == "input"
        # Asking for one output by name, on the versioned path.
        response = await client.post(
            "/v2/models/demo/versions/1/infer",
            json=family_request([row(2, 0.9)], outputs=[{"name": "logits"}]),
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["shape"] == [1, 10]

    api_run(world, body)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r["inputs"][0].update(name="pixels"), "input 'pixels'"),
        (lambda r: r["inputs"][0].update(datatype="INT64"), "datatype 'INT64'"),
        (lambda r: r["inputs"][0].update(shape=[1, 63]), "input 'input': shape"),
        (lambda r: r["inputs"][0].update(data=[1.0] * 10), "input 'input': 'data' holds 10"),
        (lambda r: r.update(outputs=[{"name": "probs"}]), "output 'probs'"),
        (lambda r: r.update(inputs=[]), "'inputs'"),
    ],
)
def test_a_request_that_does_not_fit_is_a_400_naming_the_field(
    world: ApiWorld, change: Any, named: str
) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL])))
        request = family_request([row(1, 0.9)])
        change(request)
        response = await client.post("/v2/models/demo/infer", json=request, headers=world.auth())
        assert response.status_code == 400, response.text
        assert named in response.json()["error"]
        response = await client.post(
            "/v2/models/demo/infer", content=b"{not json", headers=world.auth()
        )
        assert response.status_code == 400 and "not JSON" in response.json()["error"]

    api_run(world, body)


def binary_request(
    arrays: dict[str, tuple[str, np.ndarray]], **parameters: Any
) -> tuple[bytes, int]:
    """A request as tritonclient sends it: the JSON header, then each input's raw bytes."""
    inputs = [
        {
            "name": name,
            "shape": list(array.shape),
            "datatype": datatype,
            "parameters": {"binary_data_size": array.nbytes},
        }
        for name, (datatype, array) in arrays.items()
    ]
    document: dict[str, Any] = {"inputs": inputs}
    if parameters:
        document["parameters"] = parameters
    header = json.dumps(document).encode()
    return header + b"".join(a.tobytes() for _, a in arrays.values()), len(header)


def test_the_binary_tensor_extension_in_and_out(world: ApiWorld) -> None:
    from tritonclient.http import InferResult

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        pixels = np.array([row(6, 0.9), row(7, 0.2)], dtype=np.float32)
        content, size = binary_request({"input": ("FP32", pixels)}, binary_data_output=True)
        headers = {**world.auth(), "Inference-Header-Content-Length": str(size)}
        response = await client.post("/v2/models/demo/infer", content=content, headers=headers)
        assert response.status_code == 200, response.text
        length = int(response.headers["inference-header-content-length"])
        result = InferResult.from_response_body(response.content, header_length=length)
        logits = result.as_numpy("logits")
        assert logits.dtype == np.float32 and logits.shape == (2, 10)
        assert logits.argmax(axis=1).tolist() == [6, 7]
        assert result.get_response()["parameters"]["models"] == ["tiny", "large"]
        # Binary in, JSON out (no binary_data_output).
        content, size = binary_request({"input": ("FP32", pixels)})
        headers = {**world.auth(), "Inference-Header-Content-Length": str(size)}
        response = await client.post("/v2/models/demo/infer", content=content, headers=headers)
        assert response.status_code == 200, response.text
        assert len(response.json()["outputs"][0]["data"]) == 20
        # Sizes that do not add up, and a header length beyond the body.
        for bad, length_text, named in [
            (content[:-4], str(size), "ends before"),
            (content + b"xxxx", str(size), "4 bytes no input claims"),
            (content, str(len(content) + 1), "not a size within the body"),
        ]:
            headers = {**world.auth(), "Inference-Header-Content-Length": length_text}
            response = await client.post("/v2/models/demo/infer", content=bad, headers=headers)
            assert response.status_code == 400, response.text
            assert named in response.json()["error"]

    api_run(world, body)


def test_a_header_length_given_twice_is_a_400_on_either_path(world: ApiWorld) -> None:
    """The fast path took the last of two ``Inference-Header-Content-Length`` headers and the
    route the first, so one body was answered two ways (the first request goes through the
    route, which caches the token; the next takes the fast path)."""

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        pixels = np.array([row(6, 0.9)], dtype=np.float32)
        content, size = binary_request({"input": ("FP32", pixels)})
        twice = [
            *world.auth().items(),
            ("Inference-Header-Content-Length", str(size)),
            ("Inference-Header-Content-Length", str(size + 4)),
        ]
        for _ in range(2):
            response = await client.post("/v2/models/demo/infer", content=content, headers=twice)
            assert response.status_code == 400, response.text
            assert "given 2 times" in response.json()["error"]
        once = [*world.auth().items(), ("Inference-Header-Content-Length", str(size))]
        response = await client.post("/v2/models/demo/infer", content=content, headers=once)
        assert response.status_code == 200, response.text

    api_run(world, body)


def test_a_binary_switch_that_is_not_a_boolean_is_a_400(world: ApiWorld) -> None:
    """``binary_data_output: "true"`` or an output's ``binary_data: 1`` had been taken for false:
    the outputs came back as JSON without a word. Refused on the route and on the fast path
    (the first request through the route, which caches the token; the next past it), before
    the query is served; a boolean is taken either way."""

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        request = family_request([row(3, 0.9)])
        for _ in range(2):
            for extra, field in [
                ({"parameters": {"binary_data_output": "true"}}, "binary_data_output"),
                ({"parameters": {"binary_data_output": None}}, "binary_data_output"),
                (
                    {"outputs": [{"name": "logits", "parameters": {"binary_data": 1}}]},
                    "outputs[0].parameters.binary_data",
                ),
            ]:
                response = await client.post(
                    "/v2/models/demo/infer", json={**request, **extra}, headers=world.auth()
                )
                assert response.status_code == 400, (extra, response.text)
                assert field in response.json()["error"]
                assert "must be true or false" in response.json()["error"]
            served = {
                **request,
                "outputs": [{"name": "logits", "parameters": {"binary_data": False}}],
            }
            response = await client.post(
                "/v2/models/demo/infer",
                json={**served, "parameters": {"binary_data_output": True}},
                headers=world.auth(),
            )
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"]  # the output's own false wins
        totals = world.serving.observations.totals()["demo"]
        assert totals.arrived == 2  # the refused ones were never served

    api_run(world, body)


def test_an_app_of_registry_models_on_v2_and_v1(world: ApiWorld) -> None:
    as_artifacts(world, TWO_INPUTS)

    async def body(client: httpx.AsyncClient) -> None:
        signatures = {"tiny": TWO_INPUTS, "large": TWO_INPUTS}
        workers = [FakeWorker(t, signatures=signatures, kind="max_prob") for t in (SMALL, LARGE)]
        for worker in workers:
            await worker.start()
        world.instances.set("demo", endpoints(workers))
        response = await client.get("/v2/models/demo", headers=world.auth())
        assert [t["name"] for t in response.json()["inputs"]] == ["ids", "mask"]
        # The fake answers class ids[0] % 4 with certainty ids[1] / 16 (max_prob).
        ids = np.array([[2, 15, 0], [1, 2, 0]], dtype=np.int64)
        mask = np.array([[True, False, True], [False, False, True]])
        content, size = binary_request(
            {"ids": ("INT64", ids), "mask": ("BOOL", mask)}, binary_data_output=True
        )
        headers = {**world.auth(), "Inference-Header-Content-Length": str(size)}
        response = await client.post("/v2/models/demo/infer", content=content, headers=headers)
        assert response.status_code == 200, response.text
        from tritonclient.http import InferResult

        length = int(response.headers["inference-header-content-length"])
        result = InferResult.from_response_body(response.content, header_length=length)
        assert result.as_numpy("scores").argmax(axis=1).tolist() == [2, 1]
        assert result.as_numpy("label").tolist() == [0, 0]
        assert result.get_response()["parameters"]["models"] == ["tiny", "large"]
        # Both workers host both models (co-located, SP3): whichever took the batch.
        sent = next((w.last_request for w in workers if w.last_request is not None), None)
        assert sent is not None and [t["datatype"] for t in sent["inputs"]] == ["INT64", "BOOL"]
        # JSON tensors: a wrong datatype for the second input names it.
        request = {
            "inputs": [tensor("ids", "INT64", ids), tensor("mask", "FP32", mask.astype(float))]
        }
        response = await client.post("/v2/models/demo/infer", json=request, headers=world.auth())
        assert response.status_code == 400 and "input 'mask'" in response.json()["error"]
        # /v1 cannot give a model of two inputs its samples.
        response = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [[1.0] * 3]}, headers=world.auth()
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "inputs" and "/v2/models/demo/infer" in error["message"]

    api_run(world, body)


def test_v1_rows_of_an_artifact_app_are_its_first_inputs_flattened_sample(
    world: ApiWorld,
) -> None:
    as_artifacts(world, ONE_INT_INPUT)

    async def body(client: httpx.AsyncClient) -> None:
        signatures = {"tiny": ONE_INT_INPUT, "large": ONE_INT_INPUT}
        workers = [FakeWorker(t, signatures=signatures) for t in (SMALL, LARGE)]
        for worker in workers:
            await worker.start()
        world.instances.set("demo", endpoints(workers))
        response = await client.post(
            "/v1/apps/demo/infer",
            json={"inputs": [[2.0, 16.0, 5.0, 7.0], [1.0, 0.0, 300.0, -4.0]]},
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["outputs"] == [2, 1]  # ids[0] % 3, argmax of the three scores
        assert answer["models"] == ["tiny", "large"]
        # The large model got the second row, its values as INT64 integers, in shape [1, 2, 2].
        sent = [w.last_request["inputs"][0] for w in workers if w.last_request is not None]
        assert {
            "name": "ids",
            "datatype": "INT64",
            "shape": [1, 2, 2],
            "data": [1, 0, 300, -4],
        } in (sent)
        for inputs, field in [
            ([[1.0, 2.0, 3.0]], "inputs[0]"),
            ([[1.0, 2.5, 3.0, 4.0]], "inputs[0][1]"),
            ([[1.0] * 4, [1.0, 2.0, 3.0, 1e20]], "inputs[1][3]"),
        ]:
            response = await client.post(
                "/v1/apps/demo/infer", json={"inputs": inputs}, headers=world.auth()
            )
            assert response.status_code == 422, response.text
            assert response.json()["error"]["field"] == field

    api_run(world, body)


def test_a_clients_timeout_is_its_deadline(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        request = family_request([row(1, 0.9)])
        response = await client.post(
            "/v2/models/demo/infer",
            json={**request, "parameters": {"timeout": 30_000_000}},
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        # 10**400: past any float (the body's JSON is read exactly): it answered 500 once.
        for bad in (0, -5, "soon", True, 10**400):
            response = await client.post(
                "/v2/models/demo/infer",
                json={**request, "parameters": {"timeout": bad}},
                headers=world.auth(),
            )
            assert response.status_code == 400, (bad, response.text)
            assert "parameters.timeout" in response.json()["error"]
        # 1e400 reads as an infinity: refused too (it was taken as no deadline at all).
        text = json.dumps(request)[:-1] + ', "parameters": {"timeout": 1e400}}'
        response = await client.post(
            "/v2/models/demo/infer",
            content=text,
            headers={**world.auth(), "content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
        assert "finite" in response.json()["error"]

    api_run(world, body)


@pytest.mark.parametrize(
    ("datatype", "sample", "sent"),
    [
        ("FP32", [3, 8, 1, 2], [3.0, 8.0, 1.0, 2.0]),
        ("FP16", [3, 8.5, 1, 2], [3.0, 8.5, 1.0, 2.0]),
        ("INT64", [3, 8, -1, 2], [3, 8, -1, 2]),
        ("INT32", [3, 8, 1, -2], [3, 8, 1, -2]),
        ("BOOL", [1, 0, 1, 1], [True, False, True, True]),
    ],
)
def test_v1_takes_json_integers_for_every_datatype(
    world: ApiWorld, datatype: str, sample: list[float], sent: list[Any]
) -> None:
    """JSON integers reach the fast path as int, not float: every datatype takes them (an
    INT64 or BOOL input answered 500 once, ``'int' object has no attribute 'is_integer'``)."""
    signature = ModelSignature(
        (TensorSpec("x", datatype, (-1, 4)),), (TensorSpec("scores", "FP32", (-1, 3)),)
    )
    as_artifacts(world, signature)

    async def body(client: httpx.AsyncClient) -> None:
        worker = FakeWorker(LARGE, signatures={"tiny": signature, "large": signature})
        await worker.start()
        world.instances.set("demo", endpoints([worker]))
        for _ in range(3):  # the first through the route, the next on the fast path
            response = await client.post(
                "/v1/apps/demo/infer", json={"inputs": [sample]}, headers=world.auth()
            )
            assert response.status_code == 200, response.text
        assert worker.last_request is not None
        (given,) = worker.last_request["inputs"]
        assert (given["datatype"], given["shape"], given["data"]) == (datatype, [1, 4], sent)
        response = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [[1, 0, 1, 2.5]]}, headers=world.auth()
        )
        if datatype.startswith("FP"):
            assert response.status_code == 200, response.text
        else:
            assert response.status_code == 422, response.text
            assert response.json()["error"]["field"] == "inputs[0][3]"
        await worker.stop()

    api_run(world, body)


def test_v1_refuses_an_int64_past_its_range_not_rounds_it(world: ApiWorld) -> None:
    """-2**63 - 1 is past orjson's 64 bits, so the route read it, as a float: -2**63, which
    passed the range check and reached the model."""
    signature = ModelSignature(
        (TensorSpec("x", "INT64", (-1, 4)),), (TensorSpec("scores", "FP32", (-1, 3)),)
    )
    as_artifacts(world, signature)

    async def body(client: httpx.AsyncClient) -> None:
        worker = FakeWorker(LARGE, signatures={"tiny": signature, "large": signature})
        await worker.start()
        world.instances.set("demo", endpoints([worker]))
        for past in (-(2**63) - 1, -(2**63) - 92, 2**63, 2**64 + 1):
            response = await client.post(
                "/v1/apps/demo/infer", json={"inputs": [[1, 2, 3, past]]}, headers=world.auth()
            )
            assert response.status_code == 422, (past, response.text)
            assert response.json()["error"]["field"] == "inputs[0][3]"
        edges = [-(2**63), 2**63 - 1, 2**53 + 1, -(2**53) - 1]
        response = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [edges]}, headers=world.auth()
        )
        assert response.status_code == 200, response.text
        assert worker.last_request is not None
        assert worker.last_request["inputs"][0]["data"] == edges  # exact, not rounded
        await worker.stop()

    api_run(world, body)


@pytest.mark.parametrize("datatype", [None, "FP32", "UINT8", "INT64"])
def test_v1_refuses_an_integer_past_any_float_in_one_line(
    world: ApiWorld, datatype: str | None
) -> None:
    """A JSON integer past any float (10**400) reaches the route exactly (orjson refuses it, the
    json module reads it): its refusal quoted it with ``:g`` and answered 500 (OverflowError),
    for the demo family's pixels (``datatype`` None) as for a registry model's input."""
    width = 64
    if datatype is not None:
        width = 4
        signature = ModelSignature(
            (TensorSpec("x", datatype, (-1, width)),), (TensorSpec("scores", "FP32", (-1, 3)),)
        )
        as_artifacts(world, signature)

    async def body(client: httpx.AsyncClient) -> None:
        world.instances.set("demo", endpoints(await fleet([SMALL, LARGE])))
        sample: list[int] = [1] * width
        sample[2] = 10**400
        response = await client.post(
            "/v1/apps/demo/infer",
            content=json.dumps({"inputs": [sample]}),
            headers={**world.auth(), "Content-Type": "application/json"},
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "inputs[0][2]"
        assert "an integer of 401 digits" in error["message"]

    api_run(world, body)


def test_check_inputs_takes_ints_and_floats_alike() -> None:
    from controlplane.api.errors import ApiError
    from controlplane.api.routes.infer import check_inputs
    from controlplane.serving.modelio import ModelIO

    for datatype, rows, wanted in [
        ("INT64", [[1, 2.0, -3]], [[1, 2, -3]]),
        ("INT32", [[2**31 - 1, 0, 1.0]], [[2**31 - 1, 0, 1]]),
        ("BOOL", [[1, 0, 1.0]], [[True, False, True]]),
        ("FP32", [[1, 2.5, 3]], [[1, 2.5, 3]]),
        ("FP16", [[1, 2.5, 3]], [[1, 2.5, 3]]),
    ]:
        signature = ModelSignature(
            (TensorSpec("x", datatype, (-1, 3)),), (TensorSpec("y", "FP32", (-1, 2)),)
        )
        io = ModelIO("m", signature)
        assert check_inputs("app", io, rows) == wanted  # type: ignore[arg-type]
    int32 = ModelIO(
        "m",
        ModelSignature((TensorSpec("x", "INT32", (-1, 1)),), (TensorSpec("y", "FP32", (-1, 2)),)),
    )
    for value in (2**31, 1.5):
        with pytest.raises(ApiError) as refused:
            check_inputs("app", int32, [[value]])  # type: ignore[list-item]
        assert refused.value.status == 422 and refused.value.field == "inputs[0][0]"


# --- tritonclient against a real server ------------------------------------------------------


class _Background:
    """An event loop in a thread, for the fake workers the real server's loop calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def live_server(world: ApiWorld, types: Sequence[str]) -> Iterator[tuple[list[FakeWorker], str]]:
    """The world's API on a real uvicorn server on a free loopback port, over fake workers of
    ``types`` on an event loop of their own; yields the workers and ``host:port``. The workers
    stop first on the way out: a call one holds ends, and the server can stop."""
    background = _Background()
    workers = background.run(fleet(list(types)))
    world.instances.set("demo", endpoints(workers))
    # heteroplane serve's socket (TCP_NODELAY: no delayed-ACK stalls) and HTTP protocol.
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    front = world.app.state.services.front_door
    config = uvicorn.Config(
        world.app, log_level="warning", lifespan="on", **server_options(front=front)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield workers, f"127.0.0.1:{port}"
    finally:
        for worker in workers:
            background.run(worker.stop())
        server.should_exit = True
        thread.join(20)
        background.close()
        sock.close()


@pytest.fixture
def live_world(world: ApiWorld) -> Iterator[tuple[ApiWorld, str]]:
    with live_server(world, [SMALL, LARGE]) as (_, address):
        yield world, address


def test_tritonclient_against_a_real_server(live_world: tuple[ApiWorld, str]) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    world, url = live_world
    auth = world.auth()

    def headers() -> dict[str, str]:
        return dict(auth)  # tritonclient adds its own to the dict it is given: one per call

    client = httpclient.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("demo", headers=headers())
        metadata = client.get_model_metadata("demo", headers=headers())
        assert metadata["inputs"][0]["shape"] == [-1, 64]
        pixels = np.array([row(8, 0.9), row(9, 0.1)], dtype=np.float32)
        for binary in (True, False):
            given = httpclient.InferInput("input", list(pixels.shape), "FP32")
            given.set_data_from_numpy(pixels, binary_data=binary)
            wanted = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
            result = client.infer(
                "demo", [given], outputs=wanted, request_id="r7", headers=headers()
            )
            assert result.as_numpy("logits").argmax(axis=1).tolist() == [8, 9]
            response = result.get_response()
            assert response["id"] == "r7" and response["parameters"]["models"] == ["tiny", "large"]
        # No outputs named: tritonclient asks for every output in binary.
        given = httpclient.InferInput("input", list(pixels.shape), "FP32")
        given.set_data_from_numpy(pixels)
        result = client.infer("demo", [given], headers=headers())
        assert result.as_numpy("logits").shape == (2, 10)
        wrong = httpclient.InferInput("input", [2, 64], "FP64")
        wrong.set_data_from_numpy(pixels.astype(np.float64))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("demo", [wrong], headers=headers())
        assert caught.value.status() == "400" and "datatype 'FP64'" in caught.value.message()
        with pytest.raises(InferenceServerException) as caught:
            client.infer("demo", [given])
        assert caught.value.status() == "401"
    finally:
        client.close()
