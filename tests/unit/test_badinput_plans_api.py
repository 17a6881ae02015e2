"""A plan preview at a rate no planning trace can be made of (1e-300 qps) is a 422 naming the
field, never a 500; and a profile file with an absurd batch size is a 422 at registration."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.api.schemas import MIN_RATE_QPS
from controlplane.service.app import create_app
from tests.component.test_api import service_parts, spec


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], Path]]:
    data_dir, settings_, clock, store = service_parts(tmp_path)
    token = store.create_token("admin", name="admin-token")
    with TestClient(create_app(settings_, store, clock), raise_server_exceptions=False) as http:
        yield http, {"Authorization": f"Bearer {token}"}, data_dir
    store.close()


def _one_line_422(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert error["message"] and "\n" not in error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rate_qps": 1e-300}, "rate_qps"),
        ({"rate_qps": 5e-324}, "rate_qps"),
        ({"rate_qps": MIN_RATE_QPS / 2}, "rate_qps"),
        ({"trace": {"rate_qps": 1e-300}}, "trace.rate_qps"),
        ({"trace": {"rate_qps": 1e-160, "duration_s": 1e5}}, "trace.rate_qps"),
    ],
)
def test_a_rate_below_the_bound_is_a_422(
    client: tuple[TestClient, dict[str, str], Path], body: dict[str, Any], field: str
) -> None:
    http, auth, _ = client
    assert http.post("/v1/apps", json=spec(), headers=auth).status_code == 201
    response = http.post("/v1/apps/toy/plans", json=body, headers=auth)
    assert response.status_code == 422, response.text
    error = _one_line_422(response.json())
    assert error["code"] == "invalid_request" and error["field"] == field
    assert f"must be greater than or equal to {MIN_RATE_QPS:g}" in error["message"]


def test_the_bound_itself_plans(client: tuple[TestClient, dict[str, str], Path]) -> None:
    http, auth, _ = client
    assert http.post("/v1/apps", json=spec(), headers=auth).status_code == 201
    response = http.post("/v1/apps/toy/plans", json={"rate_qps": MIN_RATE_QPS}, headers=auth)
    assert response.status_code == 201, response.text


def test_a_profile_with_an_absurd_batch_size_is_a_422(
    client: tuple[TestClient, dict[str, str], Path],
) -> None:
    http, auth, data_dir = client
    (data_dir / "huge.json").write_text(
        json.dumps(
            {
                "format": "heteroplane.profiles/v1",
                "profiles": [
                    {
                        "model": "m",
                        "instance_type": itype,
                        "batch_sizes": [1, 10**30],
                        "latency_ms": [[1.0], [2.0]],
                    }
                    for itype in ("g4dn.xlarge", "r5n.large", "t3.xlarge")
                ],
            }
        )
    )
    document = spec()
    document["models"] = [{"name": "m", "profiles": "huge.json"}]
    response = http.post("/v1/apps", json=document, headers=auth)
    assert response.status_code == 422, response.text
    # The API does not say what a server file holds: it names the field.
    assert _one_line_422(response.json())["field"] == "models[0].profiles"
