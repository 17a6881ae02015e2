"""The Open Inference Protocol's ``/v2`` routes under a schema-driven fuzz run: the routes are
left out of the API's OpenAPI document (the protocol is KServe's), so :data:`OIP_DOCUMENT`
describes them as the protocol does (its REST API, with Triton's binary tensor extension as an
``application/octet-stream`` body and the ``Inference-Header-Content-Length`` header), and
schemathesis runs its example, coverage and fuzzing phases over it, derandomized and bounded,
against a real uvicorn server with heteroplane serve's protocol on loopback, serving the demo app
through fake workers (``live_world``).

Every answer must be no server error (no 5xx at all: the app has running workers) and every
error the protocol's ``{"error": "one line"}`` (tritonclient formats nothing else).
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from schemathesis.core.failures import Failure

from tests.component.test_oip_routes import live_world
from tests.component.test_serving import ApiWorld, row, world
from tests.integration.test_api_fuzz import run_schema

__all__ = ["live_world", "world"]  # the fixtures, imported for this module's tests

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
        "/v2": _get(),
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
    statuses, failures = run_schema(schema)
    return len(statuses), failures, statuses


def test_the_v2_routes_answer_no_5xx_and_errors_in_the_protocols_shape(
    live_world: tuple[ApiWorld, str],
) -> None:
    world, address = live_world
    requests, failures, statuses = fuzz(f"http://{address}", world.tokens["infer"])
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(sorted(set(failures)))
    assert [s for s in statuses if s >= 500] == []
    # Every operation was tried many times, some queries served (the valid examples), many
    # refused (a broken document or token would do neither).
    assert requests >= 7 * 10, requests
    assert 200 in statuses and 400 in statuses, sorted(set(statuses))
