"""The serving loop end to end on the local fleet: real worker processes (the local provisioner),
the real service (``build_service``: store, reconciler, scheduler, serving loop) behind a real
uvicorn server on 127.0.0.1, and queries through ``POST /v1/apps/{app}/infer``.

A cascade app (``tiny@0.5 -> large`` on the demo family, with its validation records) gets a
plan placing tiny on two emu.cpu.small workers and large on one emu.cpu.large; the reconciler
launches them. A closed-loop client keeps a few queries in flight (validation samples, 1 to 4 a
query) and, once half of them are answered, one of tiny's workers is killed with SIGKILL. Every
query must get a result or an explicit error, with errors no more than the queries that were in
flight on the killed worker (one batch: the plan's batch cap, 1). Nothing sleeps but the polling
of deadlines; nothing is timed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.service.build import Service
from provisioners.local import LocalProvisioner
from tests.integration.conftest import ApiServer, launch_fleet, measure_profiles

pytest.importorskip("torch")

APP = "digits"
SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
PLACEMENT = {"tiny": {SMALL: 2}, "large": {LARGE: 1}}
QUERIES = 160
IN_FLIGHT = 6
RUN_DEADLINE_S = 300.0
POLL_S = 0.25
NOTICE_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def profiles(trained_family: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny and large on the two emulated types, from ``heteroplane profile measure``."""
    out = tmp_path_factory.mktemp("serving-profiles") / "family.json"
    return measure_profiles(trained_family, out, "tiny,large", "1,2,4,8")


@pytest.fixture
def service(local_service: Service) -> Service:
    """The service on the local provisioner (``local_service`` in the integration conftest)."""
    return local_service


def _register(service: Service, profiles: Path, family: Path) -> None:
    store = service.store
    store.create_app(
        {
            "name": APP,
            "models": [
                {"name": "tiny", "profiles": str(profiles)},
                {"name": "large", "profiles": str(profiles)},
            ],
            "cascade": ["tiny", "large"],
            "thresholds": [0.5],
            "validation": str(family / "validation.json"),
            "slo": {"latency_ms": 1000},
            "budget_usd_per_hr": 1.0,
            "instance_types": [SMALL, LARGE],
        },
        who="test",
    )
    plan = store.create_plan(
        APP,
        {
            "feasible": True,
            "cost_usd_per_hr": 0.2,
            "stages": [
                {"name": model, "fleet": fleet, "batch_size": 1, "policy": "fcfs"}
                for model, fleet in PLACEMENT.items()
            ],
        },
    )
    store.apply_plan(APP, plan.id)


def _bodies(count: int) -> tuple[list[dict[str, Any]], np.ndarray]:
    """``count`` request bodies of 1 to 4 validation samples each, and the labels."""
    from provisioners.worker.family import load_split

    split = load_split()
    inputs, labels = split.validation_inputs, split.validation_labels
    rng = np.random.default_rng(0)
    bodies = []
    for _ in range(count):
        ids = rng.integers(0, labels.size, size=int(rng.integers(1, 5))).tolist()
        bodies.append(
            {"inputs": [inputs[i].astype(float).tolist() for i in ids], "sample_ids": ids}
        )
    return bodies, labels


async def _load(
    url: str, token: str, bodies: list[dict[str, Any]], at_half: Any
) -> list[httpx.Response | Exception]:
    """Send every body, at most IN_FLIGHT at once; call ``at_half`` once half are answered."""
    answers: list[httpx.Response | Exception] = [RuntimeError("not sent")] * len(bodies)
    next_index = 0
    done = 0
    fired = False
    headers = {"Authorization": f"Bearer {token}"}

    async def sender(client: httpx.AsyncClient) -> None:
        nonlocal next_index, done, fired
        while next_index < len(bodies):
            index = next_index
            next_index += 1
            try:
                answers[index] = await client.post(
                    f"/v1/apps/{APP}/infer", json=bodies[index], headers=headers
                )
            except httpx.HTTPError as error:
                answers[index] = error
            done += 1
            if not fired and done >= len(bodies) // 2:
                fired = True
                await asyncio.to_thread(at_half)

    async with httpx.AsyncClient(base_url=url, timeout=120.0, trust_env=False) as client:
        await asyncio.wait_for(
            asyncio.gather(*(sender(client) for _ in range(IN_FLIGHT))), RUN_DEADLINE_S
        )
    return answers


def test_every_query_gets_an_answer_when_a_worker_dies_mid_run(
    service: Service, profiles: Path, trained_family: Path
) -> None:
    _register(service, profiles, trained_family)
    running = launch_fleet(service, APP, 3)
    token = service.store.create_token("infer", name="loader")
    viewer = service.store.create_token("viewer", name="watcher")
    bodies, labels = _bodies(QUERIES)
    provisioner = service.provisioner
    assert isinstance(provisioner, LocalProvisioner)
    victim = next(r for r in running if r.instance_type == SMALL)
    (record,) = [w for w in provisioner.records() if w.provider_id == victim.provider_id]

    def kill_victim() -> None:
        os.kill(record.pid, signal.SIGKILL)

    with ApiServer(service) as url:
        answers = asyncio.run(_load(url, token, bodies, kill_victim))
        # A call to the victim, or its idle probe (idle_probe_s) when no query went its way after
        # the kill, takes it out of matching; the reconciler may have replaced it already.
        deadline = time.monotonic() + NOTICE_DEADLINE_S
        while True:
            status = httpx.get(
                f"{url}/v1/apps/{APP}/serving",
                headers={"Authorization": f"Bearer {viewer}"},
                trust_env=False,
                timeout=30.0,
            ).json()
            workers = {w["instance_id"]: w for w in status["workers"]}
            if victim.id not in workers or not workers[victim.id]["healthy"]:
                break
            assert time.monotonic() < deadline, f"the killed worker still healthy: {workers}"
            time.sleep(POLL_S)
        metrics = httpx.get(
            f"{url}/metrics",
            headers={"Authorization": f"Bearer {viewer}"},
            trust_env=False,
            timeout=30.0,
        ).text

    errors = []
    correct = labelled = 0
    answered_by: set[str] = set()
    for body, answer in zip(bodies, answers, strict=True):
        assert isinstance(answer, httpx.Response), answer  # an answer, never a broken call
        if answer.status_code != 200:
            error = answer.json()["error"]  # an explicit error in the API's shape
            assert error["code"] and error["message"]
            errors.append((answer.status_code, error["code"]))
            continue
        result = answer.json()
        n = len(body["inputs"])
        assert len(result["outputs"]) == len(result["models"]) == len(result["certainty"]) == n
        assert set(result["models"]) <= {"tiny", "large"}
        assert result["gear"] == "tiny@0.5 -> large"
        answered_by.update(result["models"])
        for output, sample in zip(result["outputs"], body["sample_ids"], strict=True):
            labelled += 1
            correct += int(output == int(labels[sample]))
    # At most the queries one batch on the killed worker held (batch cap 1); re-dispatch
    # usually saves even those.
    assert len(errors) <= 1, errors
    assert answered_by == {"tiny", "large"}  # the cascade forwarded the unsure samples
    assert correct / labelled > 0.8  # real answers of real models (tiny alone: 95%)
    assert status["totals"]["answered"] == QUERIES - len(errors)
    assert f'heteroplane_serving_queries_total{{app="{APP}",outcome="answered"}}' in metrics
    decisions = [d.kind for d in service.store.list_decisions(APP)]
    if victim.id in workers:
        assert "worker_unhealthy" in decisions
