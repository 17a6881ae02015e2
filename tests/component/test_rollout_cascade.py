"""A rollout of a cascade member (controlplane.apps.rollouts, controlplane.loops.rollouts): the
cascade's thresholds are re-derived on validation records with the new version and its held-out
accuracy stated before traffic moves; the new version's workers serve the cascade with the new
thresholds; promotion pins the spec to them. The real serving loop and API over fake worker
agents, a real SQLite store; the rollout loop ticked by hand on a fake clock.

The validation records are made so that the answer is known: the new ``tiny`` is right exactly
on the samples of certainty >= 0.65 and ``large`` on all, so the cheapest threshold within half
a point of ``large`` alone is the grid's 0.7 (the app's was 0.5).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.apps.rollouts import RolloutRequest, start_rollout
from controlplane.errors import InvalidValueError
from controlplane.policies.lifecycle import InstanceState
from controlplane.policies.rollout import Thresholds, rollout_request_prefix
from controlplane.serving.workers import WorkerEndpoint
from tests.component import test_rollout_serving as serving_tests
from tests.component.test_rollout_serving import fleet, row, run

SMALL = "emu.cpu.small"
APP = "digits"
SHA = "ef" * 32
SAMPLES = 400


def records(tiny_right_from: float = 0.65) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 10, SAMPLES)
    certainty = rng.uniform(0.0, 1.0, SAMPLES)
    tiny_right = certainty >= tiny_right_from
    tiny = np.where(tiny_right, labels, (labels + 1) % 10)
    return {
        "format": "heteroplane.validation/v1",
        "labels": labels.tolist(),
        "models": [
            {
                "name": "tiny",
                "accuracy": float(tiny_right.mean()),
                "predictions": tiny.tolist(),
                "correct": tiny_right.tolist(),
                "certainty": certainty.tolist(),
            },
            {
                "name": "large",
                "accuracy": 1.0,
                "predictions": labels.tolist(),
                "correct": [True] * SAMPLES,
                "certainty": [0.9] * SAMPLES,
            },
        ],
    }


class World(serving_tests.World):
    """The cascade app over the rollout tests' world."""

    def __init__(self, tmp_path: Path) -> None:
        spec = {
            "name": APP,
            "models": [
                {"name": "tiny", "profiles": "profiles.csv", "artifact": "digits-tiny@1"},
                {"name": "large", "profiles": "profiles.csv", "artifact": "digits-large@1"},
            ],
            "cascade": ["tiny", "large"],
            "thresholds": [0.5],
            "validation": "validation.json",
            "slo": {"latency_ms": 5000},
            "budget_usd_per_hr": 5,
            "instance_types": [SMALL],
        }
        files = {"validation.json": json.dumps(records(0.4))}
        super().__init__(tmp_path, spec, {"tiny": 1.0, "large": 4.0}, files)

    def start(self, validation: dict[str, Any] | None) -> Any:
        request = RolloutRequest(
            "digits-tiny@2", (1.0,), 10.0, False, Thresholds(min_queries=5), validation
        )
        return start_rollout(self.store, self.resolver, APP, request, who="test")


@pytest.fixture
def world(tmp_path: Path) -> Any:
    made = World(tmp_path)
    yield made
    made.store.close()


def test_a_cascade_member_needs_validation_records(world: World) -> None:
    with pytest.raises(InvalidValueError, match="member of the cascade tiny -> large"):
        world.start(None)
    with pytest.raises(InvalidValueError, match="validation"):
        world.start({"format": "heteroplane.validation/v1", "labels": [1]})
    assert world.store.list_rollouts(APP) == []


def test_the_thresholds_are_re_derived_served_and_pinned(world: World) -> None:
    rollout = world.start(records())
    cascade = rollout.settings["cascade"]
    assert cascade["thresholds_before"] == [0.5] and cascade["thresholds"] == [0.7]
    assert cascade["held_out_accuracy"] == pytest.approx(1.0)
    assert cascade["held_out_samples"] == SAMPLES // 2
    assert cascade["held_out_accuracy_before"] is not None
    (started,) = world.store.list_decisions(APP, kinds=["rollout"])
    assert "cascade thresholds re-derived for the new version: [0.7]" in started.reason
    assert "held-out accuracy 1.0000 on 200 samples" in started.reason

    async def body() -> None:
        await world.serving.start()
        try:
            old, new = await fleet(), await fleet()
            world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
            world.provider.address = new[0].address
            await asyncio.to_thread(world.rollouts.tick)
            prefix = rollout_request_prefix(APP, rollout.id)
            for r in world.store.list_instances(APP):
                if r.request_id.startswith(prefix):
                    world.store.transition_instance(r.id, InstanceState.RUNNING.value, reason="up")
            world.instances.set(prefix, [WorkerEndpoint("new-0", SMALL, new[0].address)])
            await asyncio.to_thread(world.rollouts.tick)
            transport = httpx.ASGITransport(app=world.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://hp") as client:
                answer = await client.post(
                    f"/v1/apps/{APP}/infer",
                    json={"inputs": [row(3)]},
                    headers={"Authorization": f"Bearer {world.token}", "X-Request-Id": "a"},
                )
                # Two validation samples, one answered with its label (the fake workers answer
                # a row's first value), one not: the new version's accuracy is a half.
                labels = records(0.4)["labels"]
                labelled = await client.post(
                    f"/v1/apps/{APP}/infer",
                    json={"inputs": [row(labels[0]), row(labels[1] + 1)], "sample_ids": [0, 1]},
                    headers={"Authorization": f"Bearer {world.token}", "X-Request-Id": "b"},
                )
            assert answer.status_code == 200, answer.text
            assert labelled.status_code == 200, labelled.text
            # The one step is 100 %: the new version's workers, the new thresholds.
            assert answer.json()["gear"] == "tiny@0.7 -> large"
            assert new[0].requests >= 7 and old[0].requests == 0  # 6 timed it alone
            figures = world.serving.versions.figures(APP, rollout.id, 0)["digits-tiny@2"]
            assert (figures.labelled, figures.correct, figures.accuracy) == (2, 1, 0.5)
        finally:
            await world.serving.stop()

    run(body())
    # The step's interval passes with enough good answers of the new version (the queries
    # above and four more, recorded as the serving loop records them).
    world.clock.advance(11.0)
    for _ in range(4):
        world.rollouts.meter.answered(APP, _route(world), "digits-tiny@2", 1.0)
    (promoted,) = [t.what for t in world.rollouts.tick()]
    assert promoted.startswith("promoted"), promoted
    spec = world.store.get_app(APP).spec
    assert spec["thresholds"] == [0.7]
    # Named in the data directory, no path of the server's shown (a spec's relative path).
    assert spec["validation"] == cascade["validation"]
    assert spec["validation"] == f"rollouts/{APP}-tiny-2-validation.json"
    assert (world.resolver.base_dir / spec["validation"]).exists()
    assert spec["models"][0]["artifact"] == "digits-tiny@2"
    assert world.resolver.resolve(spec).validation.model_accuracy("tiny") < 1.0


def _route(world: World) -> Any:
    route = world.rollouts.route(APP)
    assert route is not None
    return route
