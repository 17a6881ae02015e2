"""Errors on the Open Inference Protocol's ``/v2`` routes are the protocol's ``{"error": "..."}``
whichever layer answers (the route, the token check, the body and header limits, an unknown
route, 405), bodies nested too deep are a 400 and bodies over the limit a 413 whether their
length is declared or not (chunked), and the limit admits the 256 rows of the model's input
that docs/models.md promises, computed from its signature (:func:`body_limit`); ``/v1`` keeps
the API's own error body.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.api.limits import MAX_BODY_BYTES, MAX_HEADER_BYTES
from controlplane.api.routes.oip import body_limit, check_binary_switches, config_signature
from controlplane.api.schemas import MAX_INFER_SAMPLES
from controlplane.serving.modelio import ModelIO
from provisioners.artifacts import ModelSignature, TensorSpec
from provisioners.worker.oip import OipError
from tests.component.test_oip_routes import as_artifacts, binary_request, family_request
from tests.component.test_serving import (
    LARGE,
    SMALL,
    ApiWorld,
    api_run,
    config,
    endpoints,
    fleet,
    row,
    world,
)

__all__ = ["world"]  # the fixture, imported for this module's tests

IMAGES = ModelSignature(
    (TensorSpec("pixels", "FP32", (-1, 3, 32, 32)),), (TensorSpec("logits", "FP32", (-1, 10)),)
)
INFER = "/v2/models/demo/infer"
DEEP = b"[" * 100_000 + b"]" * 100_000


async def chunks(body: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    """``body`` sent chunked (no Content-Length)."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def oip_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and error, response.text
    return error


def test_every_error_on_v2_is_the_protocols_shape(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        auth = world.auth()
        json_headers = {**auth, "Content-Type": "application/json"}
        oversized = json.dumps(family_request([row(1, 0.9)] * 10)).encode() + b" " * (2 << 20)
        cases: list[tuple[int, str, str, dict[str, Any]]] = [
            (404, "GET", "/v2/nothing", {}),
            (404, "GET", "/v2/models/nope", {"headers": auth}),
            (405, "DELETE", INFER, {"headers": auth}),
            (401, "POST", INFER, {"json": family_request([row(1, 0.9)])}),
            (403, "POST", INFER, {"json": {}, "headers": world.auth("viewer")}),
            (400, "POST", INFER, {"content": b"{not json", "headers": json_headers}),
            (400, "POST", INFER, {"content": DEEP, "headers": json_headers}),
            (400, "POST", INFER, {"content": b'{"inputs": ' + DEEP + b"}", "headers": auth}),
            (413, "POST", INFER, {"content": oversized, "headers": json_headers}),
            (413, "POST", INFER, {"content": chunks(oversized), "headers": json_headers}),
            (
                431,
                "GET",
                "/v2/health/live",
                {"headers": {"X-Padding": "x" * (MAX_HEADER_BYTES + 1)}},
            ),
        ]
        for status, method, path, options in cases:
            response = await client.request(method, path, **options)
            message = oip_error(response, status)
            if status == 413:
                assert "larger than" in message
        response = await client.post(INFER, content=DEEP, headers=json_headers)
        assert "nested deeper" in oip_error(response, 400)

    api_run(world, body)


def test_v1_keeps_the_apis_error_body(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        headers = {**world.auth(), "Content-Type": "application/json"}
        oversized = b'{"inputs": [[1.0]]}' + b" " * (2 * MAX_BODY_BYTES)
        for status, content in [
            (400, DEEP),
            (413, oversized),
            (413, chunks(oversized)),
        ]:
            response = await client.post("/v1/apps/demo/infer", content=content, headers=headers)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) == {"code", "message", "field"}

    api_run(world, body)


def test_the_body_limit_admits_256_rows_of_the_models_input(world: ApiWorld) -> None:
    """256 rows of [3, 32, 32] FP32 as JSON (about 4 MB, past the API's 1 MiB) and in binary
    get past the limit and the parser (503: no worker serves the app here); 257 rows are the
    protocol's 400, and more bytes than the limit a 413."""
    as_artifacts(world, IMAGES)
    rng = np.random.default_rng(7)
    pixels = (rng.standard_normal((MAX_INFER_SAMPLES, 3, 32, 32)) * 1e-5).astype(np.float32)
    request = {
        "inputs": [
            {
                "name": "pixels",
                "datatype": "FP32",
                "shape": list(pixels.shape),
                "data": pixels.tolist(),
            }
        ]
    }

    async def body(client: httpx.AsyncClient) -> None:
        headers = {**world.auth(), "Content-Type": "application/json"}
        content = json.dumps(request).encode()
        assert len(content) > MAX_BODY_BYTES
        response = await client.post(INFER, content=content, headers=headers)
        oip_error(response, 503)
        binary, size = binary_request({"pixels": ("FP32", pixels)})
        response = await client.post(
            INFER,
            content=binary,
            headers={**world.auth(), "Inference-Header-Content-Length": str(size)},
        )
        oip_error(response, 503)
        more = np.concatenate([pixels, pixels[:1]])
        binary, size = binary_request({"pixels": ("FP32", more)})
        response = await client.post(
            INFER,
            content=binary,
            headers={**world.auth(), "Inference-Header-Content-Length": str(size)},
        )
        assert "256" in oip_error(response, 400)
        limit = body_limit(IMAGES, world.settings.oip_body_max_bytes)
        response = await client.post(INFER, content=chunks(content + b" " * limit), headers=headers)
        assert f"{limit:,}" in oip_error(response, 413)

    api_run(world, body)


@pytest.mark.parametrize(
    ("signature", "ceiling", "expected"),
    [
        (IMAGES, 64 << 20, MAX_BODY_BYTES + 256 * 3 * 32 * 32 * 25),
        (IMAGES, 4 << 20, 4 << 20),
        (
            ModelSignature(
                (TensorSpec("a", "INT64", (-1, 4)), TensorSpec("b", "BOOL", (-1, 2))),
                (TensorSpec("y", "FP32", (-1,)),),
            ),
            64 << 20,
            MAX_BODY_BYTES + 256 * 6 * 25,
        ),
        (
            ModelSignature((TensorSpec("t", "FP32", (-1, -1)),), (TensorSpec("y", "FP32", (-1,)),)),
            8 << 20,
            8 << 20,
        ),
    ],
    ids=["images", "capped", "two-inputs", "open-size"],
)
def test_body_limit_from_the_signature(
    signature: ModelSignature, ceiling: int, expected: int
) -> None:
    assert body_limit(signature, ceiling) == expected


_FEATURES = ",".join(["0.5"] * 64).encode()
# A query of the demo app (one FP32 [1, 64] input) as JSON text, so that a string can be a lone
# surrogate (\ud800, which json reads and no answer can encode) where the test puts it.
_QUERY = (
    b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":[' + _FEATURES + b"]}]"
)


@pytest.mark.parametrize(
    "content",
    [
        b'{"id":"\\ud800",' + _QUERY[1:] + b"}",
        b'{"\\ud800":1,' + _QUERY[1:] + b"}",
        _QUERY + b',"parameters":{"tag":"\\udfff"}}',
        _QUERY + b',"outputs":[{"name":"logits\\ud800"}]}',
        _QUERY.replace(b'"input"', b'"input\\ud800"') + b"}",
    ],
    ids=["id", "key", "parameter", "output-name", "input-name"],
)
def test_text_that_is_not_utf8_is_a_400_before_the_worker_runs(
    world: ApiWorld, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone surrogate anywhere in the body (JSON, the JSON part of a binary body, on the
    versioned path) is refused before the query is served, by a message that encodes, with
    nothing logged; an answer that echoes the id cannot fail after the worker ran."""

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL, LARGE])
        world.instances.set("demo", endpoints(workers))
        headers = {**world.auth(), "Content-Type": "application/json"}
        for path in (INFER, "/v2/models/demo/versions/1/infer"):
            response = await client.post(path, content=content, headers=headers)
            assert "is not UTF-8 text" in oip_error(response, 400)
        # Triton's binary form: the same JSON part, then the input's raw bytes.
        document = content.replace(b',"data":[' + _FEATURES + b"]", b"")
        document = document.replace(
            b'"shape":[1,64]', b'"shape":[1,64],"parameters":{"binary_data_size":256}'
        )
        response = await client.post(
            INFER,
            content=document + np.zeros(64, dtype="<f4").tobytes(),
            headers={**world.auth(), "Inference-Header-Content-Length": str(len(document))},
        )
        assert "is not UTF-8 text" in oip_error(response, 400)
        assert all(w.requests == 0 for w in workers)
        # The same query with valid text is served, its id echoed.
        valid = content.replace(b"\\ud800", b"x").replace(b"\\udfff", b"x")
        if b'"id"' in valid:
            response = await client.post(INFER, content=valid, headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["id"] == "x"

    with caplog.at_level("WARNING"):
        api_run(world, body)
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.update(parameters="x"), "'parameters' must be an object, got str"),
        (lambda r: r.update(parameters=[1]), "'parameters' must be an object, got list"),
        (lambda r: r.update(parameters=None), "'parameters' must be an object, got null"),
        (lambda r: r["inputs"][0].update(parameters="x"), "input 'input': 'parameters'"),
        (lambda r: r["inputs"][0].update(parameters=None), "input 'input': 'parameters'"),
        (
            lambda r: r.update(outputs=[{"name": "logits", "parameters": "x"}]),
            "outputs[0]: 'parameters' must be an object",
        ),
        (
            lambda r: r.update(outputs=[{"name": "logits", "parameters": None}]),
            "outputs[0]: 'parameters' must be an object",
        ),
        (
            # Shared memory and classification (tritonclient's class_count): not served, and
            # not ignored (the whole tensor had been answered inline).
            lambda r: r.update(
                outputs=[
                    {
                        "name": "logits",
                        "parameters": {
                            "classification": 2,
                            "shared_memory_region": "r1",
                            "binary_data": False,
                        },
                    }
                ]
            ),
            "output 'logits': parameters are not served (classification, shared_memory_region)",
        ),
        (lambda r: r["inputs"][0]["data"].__setitem__(3, True), "FP32 data must be numbers"),
        (lambda r: r["inputs"][0].update(data=[True] * 64), "FP32 data must be numbers"),
    ],
)
def test_json_of_the_wrong_type_is_a_400_naming_the_field(
    world: ApiWorld, change: Any, field: str
) -> None:
    """``parameters`` is an object wherever the protocol has one (null included: neither its
    text nor tritonclient sends null); a boolean is not an FP32 value."""

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL])
        world.instances.set("demo", endpoints(workers))
        request = family_request([row(1, 0.9)])
        change(request)
        response = await client.post(INFER, json=request, headers=world.auth())
        assert field in oip_error(response, 400)
        assert workers[0].requests == 0

    api_run(world, body)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"parameters": {"binary_data_output": None}},
            "parameters.binary_data_output must be true or false, got null",
        ),
        (
            {
                "parameters": {"binary_data_output": True},
                "outputs": [{"name": "a"}, "b", {"name": "c", "parameters": {"binary_data": 1}}],
            },
            "outputs[2].parameters.binary_data must be true or false, got int 1",
        ),
        ({"outputs": [{"name": "a", "parameters": {"binary_data": False}}]}, None),
    ],
)
def test_a_binary_switch_is_refused_naming_where_it_is(
    document: dict[str, Any], message: str | None
) -> None:
    if message is None:
        check_binary_switches(document)
        return
    with pytest.raises(OipError) as refused:
        check_binary_switches(document)
    assert str(refused.value) == message


def test_a_configs_signature_is_its_own_once_worked_out() -> None:
    """An app's ``/v2`` signature is worked out once per config (not once per query) and a
    new config, as a changed spec or plan makes, gets its own."""
    first = config()
    assert config_signature(first) is config_signature(first)
    assert config_signature(first).inputs[0].shape == (-1, 64)  # the demo family's pixels
    images = ModelIO("large", IMAGES)
    changed = dataclasses.replace(first, io={"tiny": ModelIO("tiny", IMAGES), "large": images})
    assert config_signature(changed) == IMAGES
    assert config_signature(first).inputs[0].shape == (-1, 64)
