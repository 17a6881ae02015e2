"""The Open Inference Protocol's ``/v2`` routes under a schema-driven fuzz run: the routes are
left out of the API's OpenAPI document (the protocol is KServe's), so :data:`OIP_DOCUMENT`
describes them as the protocol does (its REST API, with Triton's binary tensor extension as an
``application/octet-stream`` body and the ``Inference-Header-Content-Length`` header), and
schemathesis runs its example, coverage and fuzzing phases over it, derandomized and bounded,
against a real uvicorn server on loopback serving the demo app through fake workers.

Every answer must be no server error (no 5xx at all: the app has running workers) and every
error the protocol's ``{"error": "one line"}`` (tritonclient formats nothing else).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import uvicorn
from schemathesis.core.failures import Failure
from schemathesis.engine import Status, events, from_schema

from controlplane.cli.serve import listen
from controlplane.service.protocol import server_options
from tests.component.test_oip_routes import _Background
from tests.component.test_serving import LARGE, SMALL, ApiWorld, endpoints, fleet, row, world

__all__ = ["world"]  # the fixture, imported for this module's tests

MAX_EXAMPLES = int(os.environ.get("HETEROPLANE_FUZZ_EXAMPLES", "15"))
SEED = int(os.environ.get("HETEROPLANE_FUZZ_SEED", "31"))

_DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
_ERROR = {
    "description": "an error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "string"}},
            }
        }
    },
}
_ANY_JSON = {"description": "an answer", "content": {"application/json": {"schema": {}}}}
_MODEL = {
    "name": "model_name",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "example": "demo",
}
_VERSION = {
    "name": "model_version",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "example": "1",
}
_VALID_JSON = {
    "id": "fuzz",
    "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row(3, 0.9)}],
}
_BINARY_HEADER = json.dumps(
    {
        "inputs": [
            {
                "name": "input",
                "shape": [1, 64],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 256},
            }
        ],
        "parameters": {"binary_data_output": True},
    }
)
_INFER = {
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
        }
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/InferenceRequest"},
                "example": _VALID_JSON,
            },
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "example": _BINARY_HEADER + "\u0000" * 256,
            },
        },
    },
    "responses": {"200": _ANY_JSON, "default": _ERROR},
}


def _get(*parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "get": {"parameters": list(parameters), "responses": {"200": _ANY_JSON, "default": _ERROR}}
    }


OIP_DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "Open Inference Protocol (REST) on heteroplane", "version": "2"},
    "paths": {
        "/v2/health/live": _get(),
        "/v2/health/ready": _get(),
        "/v2/models/{model_name}": _get(_MODEL),
        "/v2/models/{model_name}/ready": _get(_MODEL),
        "/v2/models/{model_name}/versions/{model_version}": _get(_MODEL, _VERSION),
        "/v2/models/{model_name}/infer": {
            "post": {**_INFER, "parameters": [_MODEL, *_INFER["parameters"]]}
        },
        "/v2/models/{model_name}/versions/{model_version}/infer": {
            "post": {**_INFER, "parameters": [_MODEL, _VERSION, *_INFER["parameters"]]}
        },
    },
    "components": {
        "schemas": {
            "InferenceRequest": {
                "type": "object",
                "required": ["inputs"],
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {"type": "object"},
                    "inputs": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"$ref": "#/components/schemas/RequestInput"},
                    },
                    "outputs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {
                                "name": {"type": "string"},
                                "parameters": {"type": "object"},
                            },
                        },
                    },
                },
            },
            "RequestInput": {
                "type": "object",
                "required": ["name", "shape", "datatype", "data"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "datatype": {"type": "string", "enum": _DATATYPES},
                    "parameters": {"type": "object"},
                    "data": {"type": "array"},
                },
            },
        }
    },
}


@pytest.fixture
def served(world: ApiWorld) -> Iterator[tuple[ApiWorld, str]]:
    """The world's app under uvicorn with heteroplane serve's protocol on a loopback port
    (:func:`~controlplane.cli.serve.listen`'s socket: TCP_NODELAY, no delayed-ACK stalls), the
    demo app served by two fake workers on a loop of their own."""
    background = _Background()
    workers = background.run(fleet([SMALL, LARGE]))
    world.instances.set("demo", endpoints(workers))
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(world.app, log_level="warning", lifespan="on", **server_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield world, f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        for worker in workers:
            background.run(worker.stop())
        background.close()
        sock.close()


class NotTheProtocolsError(Failure):
    """An error answer whose body is not ``{"error": "..."}``."""


@schemathesis.check
def oip_error_shape(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    if response.status_code < 400:
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if not isinstance(error, str):
        raise NotTheProtocolsError(
            operation=case.operation.label,
            title="Not the protocol's error body",
            message=f"{response.status_code}: {response.content[:200]!r}",
        )
    return None


def fuzz(url: str, token: str) -> tuple[int, list[str], list[int]]:
    """Run schemathesis over :data:`OIP_DOCUMENT`: the requests, the failures, the statuses."""
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "base-url": url,
            "headers": {"Authorization": f"Bearer {token}"},
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
            "phases": {"stateful": {"enabled": False}},
            "checks": {
                "enabled": False,
                "not_a_server_error": {"enabled": True},
                "oip_error_shape": {"enabled": True},
            },
        }
    )
    schema = schemathesis.openapi.from_dict(OIP_DOCUMENT, config=config)
    requests = 0
    failures: list[str] = []
    statuses: list[int] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            for interaction in recorder.interactions.values():
                if interaction.response is not None:
                    requests += 1
                    statuses.append(interaction.response.status_code)
            for case_id, checks in recorder.checks.items():
                for check in checks:
                    if check.status != Status.FAILURE or check.failure_info is None:
                        continue
                    interaction = recorder.interactions.get(case_id)
                    answer = interaction.response if interaction is not None else None
                    body = answer.content[:300].decode(errors="replace") if answer else ""
                    failures.append(
                        f"{event.label}: {check.name}: {check.failure_info.failure.title}\n"
                        f"  {check.failure_info.code_sample}\n  -> {body}"
                    )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"schemathesis error: {event}")
    return requests, failures, statuses


def test_the_v2_routes_answer_no_5xx_and_errors_in_the_protocols_shape(
    served: tuple[ApiWorld, str],
) -> None:
    world, address = served
    requests, failures, statuses = fuzz(f"http://{address}", world.tokens["infer"])
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(sorted(set(failures)))
    assert [s for s in statuses if s >= 500] == []
    # Every operation was tried many times, some queries served (the valid examples), many
    # refused (a broken document or token would do neither).
    assert requests >= 7 * 10, requests
    assert 200 in statuses and 400 in statuses, sorted(set(statuses))
