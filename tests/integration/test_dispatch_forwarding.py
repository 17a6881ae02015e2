"""Several serving processes on one PostgreSQL database (docs/service.md, "Several serving
processes"): two ``heteroplane serve`` processes (each with its loops process) and a local
worker; ``/v1``, ``/v2`` and gRPC ModelInfer queries sent to both are all answered, and every
one of them is answered by the app's one dispatcher (its ``/metrics`` counts them all, the
other's none); a query the dispatcher refuses is refused with its status through the other.

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import needs_shared
from tests.integration.test_replicas import (
    _local_profile,
    apply_local_app,
    stop_local_workers,
    tails_of,
    wait_for,
)
from tests.integration.test_serve import Server, store_token

pytestmark = needs_shared

APP = "forwarded"
DIGIT = [float(i % 17) for i in range(64)]


def _answers(api: httpx.Client) -> bool:
    return api.post(f"/v1/apps/{APP}/infer", json={"inputs": [DIGIT]}).status_code == 200


def answered(server: Server, headers: dict[str, str], app: str) -> float:
    """The queries of ``app`` the serving process behind ``server`` has answered itself."""
    wanted = f'heteroplane_serving_queries_total{{app="{app}",outcome="answered"}}'
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30.0).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))


def _v2_query(api: httpx.Client) -> dict[str, Any]:
    """One row of the app's first input, as the Open Inference Protocol sends it."""
    metadata = api.get(f"/v2/models/{APP}").json()
    first = metadata["inputs"][0]
    return {
        "inputs": [
            {"name": first["name"], "shape": [1, len(DIGIT)], "datatype": "FP32", "data": DIGIT}
        ]
    }


@pytest.mark.slow  # two services on PostgreSQL, each with its loops process, and a worker: ~40 s
def test_two_serving_processes_answer_every_query_through_the_apps_dispatcher(
    postgres_url: str, tmp_path: Path, trained_family: Path
) -> None:
    from tests.integration.conftest import free_port, local_data_dir

    data_dir = local_data_dir(tmp_path, trained_family)
    profile = _local_profile(data_dir)
    common = {
        "database_url": postgres_url,
        "provisioner": "local",
        "tuner_tick_s": "3600",
        "reconcile_s": "0.5",
    }
    grpc_ports = [free_port(), free_port()]
    servers = [
        Server(data_dir, tmp_path / f"{n}.log", grpc_port=str(port), **common)
        for n, port in zip(("a", "b"), grpc_ports, strict=True)
    ]
    try:
        logs = tails_of(servers)
        headers = {"Authorization": f"Bearer {store_token(postgres_url)}"}
        apis = [httpx.Client(base_url=s.url, headers=headers, timeout=120.0) for s in servers]
        apply_local_app(apis[0], APP, profile)
        for api in apis:
            wait_for("an answer", lambda api=api: True if _answers(api) else None, logs)

        # Which one dispatches the app: the one that answered what it was sent itself; wait
        # until the other has read the lease and forwards (its own count stays).
        def settled() -> tuple[int, int] | None:
            before = [answered(s, headers, APP) for s in servers]
            if not all(_answers(api) for api in apis):
                return None
            after = [answered(s, headers, APP) for s in servers]
            gained = [a - b for a, b in zip(after, before, strict=True)]
            return (0, 1) if gained == [2, 0] else (1, 0) if gained == [0, 2] else None

        owner, other = wait_for("one dispatcher for the app", settled, logs)
        before = [answered(s, headers, APP) for s in servers]
        query = _v2_query(apis[other])
        sent = 0
        for api in (apis[owner], apis[other]) * 5:
            assert _answers(api), logs()
            v2 = api.post(f"/v2/models/{APP}/infer", json=query)
            assert v2.status_code == 200, v2.text
            sent += 2
        # gRPC's ModelInfer, to each process: the other forwards it to the dispatcher too.
        grpcclient = pytest.importorskip("tritonclient.grpc")
        name = query["inputs"][0]["name"]
        grpc_headers = {"authorization": headers["Authorization"]}
        for port in (grpc_ports[owner], grpc_ports[other]) * 2:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            given = grpcclient.InferInput(name, [1, len(DIGIT)], "FP32")
            given.set_data_from_numpy(np.array([DIGIT], dtype=np.float32))
            result = client.infer(APP, [given], headers=grpc_headers)
            rest = apis[owner].post(f"/v2/models/{APP}/infer", json=query).json()
            (output,) = rest["outputs"]
            np.testing.assert_allclose(
                result.as_numpy(output["name"]).ravel(), np.array(output["data"]), rtol=1e-6
            )
            assert result.get_response().parameters["models"].string_param
            sent += 2
            # A query the dispatcher refuses (a row too short) is refused as it refused it.
            short = grpcclient.InferInput(name, [1, 3], "FP32")
            short.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
            with pytest.raises(grpcclient.InferenceServerException) as refused:
                client.infer(APP, [short], headers=grpc_headers)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
            client.close()
        after = [answered(s, headers, APP) for s in servers]
        assert after[owner] - before[owner] == sent
        assert after[other] == before[other]
        for api in apis:
            api.close()
    finally:
        for server in servers:
            server.stop()
        stop_local_workers(data_dir)
