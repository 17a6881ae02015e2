"""The Open Inference Protocol over gRPC against the real service and a real worker (issue 30):
``tritonclient.grpc.InferenceServerClient``, as it is, drives a user's ONNX model.

The model is the bag-of-tokens classifier of ``benchmarks/bad_queries.py`` (INT64 token ids
[N, 4] in, FP32 scores [N, 3] out), pushed with ``heteroplane model push`` and served by one
``emu.cpu.large`` worker process of the local provisioner, through the whole service behind a
real uvicorn server with the gRPC server beside it, as ``heteroplane serve`` runs them
(:func:`controlplane.api.grpc_oip.attach`). Over gRPC: the server is live and ready, the
model's metadata is its signature, and a query's outputs are the REST ``/v2`` route's for the
same query, and the model's own (onnxruntime in-process); an unknown model is ``NOT_FOUND``, a
bad token ``UNAUTHENTICATED``, a wrong shape and a token outside the vocabulary (the model
raises on it: REST's 422 ``query_rejected``) ``INVALID_ARGUMENT``, and the worker keeps serving.
Poison queries among good ones, eight calls at once (batches of several): each poison query is
``INVALID_ARGUMENT`` alone, every good one answered with the model's output, the worker healthy
throughout and never taken out of matching.

Everything is polled against deadlines; nothing is timed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from benchmarks.bad_queries import MODEL, TOKENS, VOCABULARY, export_model
from controlplane.api.grpc_oip import attach
from controlplane.service.build import Service
from tests.integration.conftest import ApiServer
from tests.integration.test_byom import _cli, service
from tests.integration.test_user_model_serving import (
    APP,
    IN_FLIGHT,
    _queries,
    _serve,
    _serving_status,
)

__all__ = ["service"]  # the fixture, imported for this module's tests

torch = pytest.importorskip("torch")
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _refusal(call: object) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call()  # type: ignore[operator]
    return raised.value


def _tokens(array: np.ndarray) -> list[object]:
    given = grpcclient.InferInput("tokens", list(array.shape), "INT64")
    given.set_data_from_numpy(array)
    return [given]


def test_tritonclient_grpc_drives_a_user_onnx_model(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_file = export_model(tmp_path)
    admin = service.store.create_token("admin", name="operator")
    infer_token = service.store.create_token("infer", name="client")
    headers = {"authorization": f"Bearer {infer_token}"}
    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    tokens = np.random.default_rng(2).integers(0, VOCABULARY, size=(5, TOKENS)).astype(np.int64)
    listener = attach(service.app, "127.0.0.1", 0, service.settings.oip_body_max_bytes)
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        _cli(capsys, "model", "push", MODEL, str(model_file))
        _serve(service, tmp_path)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{listener.port}")
        try:
            assert client.is_server_live() and client.is_server_ready()
            assert client.is_model_ready(APP, headers=headers)
            metadata = client.get_model_metadata(APP, headers=headers, as_json=True)
            assert metadata["inputs"] == [
                {"name": "tokens", "datatype": "INT64", "shape": ["-1", str(TOKENS)]}
            ]
            assert [o["datatype"] for o in metadata["outputs"]] == ["FP32"]
            output = metadata["outputs"][0]["name"]

            result = client.infer(APP, _tokens(tokens), headers=headers)
            scores = result.as_numpy(output)
            assert result.get_response().parameters["models"].string_param == ",".join(
                [MODEL] * len(tokens)
            )
            rest = httpx.post(
                f"{url}/v2/models/{APP}/infer",
                json={
                    "inputs": [
                        {
                            "name": "tokens",
                            "datatype": "INT64",
                            "shape": list(tokens.shape),
                            "data": tokens.tolist(),
                        }
                    ]
                },
                headers={"Authorization": f"Bearer {infer_token}"},
                trust_env=False,
                timeout=60.0,
            )
            assert rest.status_code == 200, rest.text
            (answer,) = rest.json()["outputs"]
            assert answer["shape"] == list(scores.shape)
            np.testing.assert_array_equal(
                np.array(answer["data"], dtype=np.float32), scores.ravel()
            )
            (own,) = session.run([output], {"tokens": tokens})
            np.testing.assert_allclose(scores, own, rtol=1e-5, atol=1e-6)

            unknown = _refusal(lambda: client.infer("nope", _tokens(tokens), headers=headers))
            assert unknown.status() == "StatusCode.NOT_FOUND", unknown.message()
            bad_token = {"authorization": "Bearer not-a-token"}
            unauthenticated = _refusal(
                lambda: client.infer(APP, _tokens(tokens), headers=bad_token)
            )
            assert unauthenticated.status() == "StatusCode.UNAUTHENTICATED"
            assert "unknown or revoked" in unauthenticated.message()
            wrong_shape = _refusal(
                lambda: client.infer(APP, _tokens(tokens[:, :3].copy()), headers=headers)
            )
            assert wrong_shape.status() == "StatusCode.INVALID_ARGUMENT"
            assert "'tokens'" in wrong_shape.message()
            poison = tokens[:1].copy()
            poison[0, 0] = VOCABULARY + 5
            rejected = _refusal(lambda: client.infer(APP, _tokens(poison), headers=headers))
            assert rejected.status() == "StatusCode.INVALID_ARGUMENT", rejected.message()
            # The worker keeps serving after the model raised on a query.
            again = client.infer(APP, _tokens(tokens), headers=headers).as_numpy(output)
            np.testing.assert_array_equal(again, scores)

            # Poison queries among good ones, IN_FLIGHT calls at once (batches of several): each
            # poison query fails alone, every good one is answered with the model's output.
            rows, bads = _queries()
            rows, bads = rows[:36], bads[:36]

            def call(row: list[int]) -> Any:
                try:
                    given = _tokens(np.array([row], dtype=np.int64))
                    return client.infer(APP, given, headers=headers).as_numpy(output)
                except InferenceServerException as error:
                    return error

            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                answers = list(pool.map(call, rows))
            serving = _serving_status(url, admin)
        finally:
            client.close()
    for row, bad, answer in zip(rows, bads, answers, strict=True):
        if bad:
            assert isinstance(answer, InferenceServerException), answer
            assert answer.status() == "StatusCode.INVALID_ARGUMENT", answer.message()
            assert "out of" in answer.message(), answer.message()
            continue
        assert isinstance(answer, np.ndarray), answer
        (own,) = session.run([output], {"tokens": np.array([row], dtype=np.int64)})
        np.testing.assert_allclose(answer, own, rtol=1e-5, atol=1e-6)
    (worker,) = serving["workers"]
    assert worker["healthy"] and worker["last_error"] == "", worker
    assert "worker_unhealthy" not in [d.kind for d in service.store.list_decisions(APP)]
