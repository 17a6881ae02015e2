"""Bounded planning through the API: a preview at a huge budget completes (the ranking does not
enumerate every affordable mix), a preview past the settings' deadline is a one-line 422, and the
Kairos search stops at a deadline with its memory bounded by blocks, not by the budget."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.service.app import create_app
from controlplane.settings import Settings
from estimator import deadline
from estimator.bounds import kairos_quantities, rank_configurations
from estimator.profiles import load_profiles
from tests.conftest import KAIROS_CSV

SAMPLES = KAIROS_CSV
TYPES = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"]

pytestmark = pytest.mark.skipif(not SAMPLES.is_file(), reason="../shared/data is not beside us")


def rm2(budget: float) -> dict[str, object]:
    return {
        "name": "rm2",
        "models": [{"name": "rm2", "profiles": "kairos.csv.gz"}],
        "slo": {"latency_ms": 350, "percentile": 99},
        "budget_usd_per_hr": budget,
        "instance_types": TYPES,
    }


def client_with(tmp_path: Path, deadline_s: float) -> Iterator[tuple[TestClient, str]]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    shutil.copy(SAMPLES, data_dir / "kairos.csv.gz")
    settings = Settings(data_dir=data_dir, provisioner="fake", plan_deadline_s=deadline_s)
    clock = FakeClock()
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    token = store.create_token("admin", name="admin")
    with TestClient(create_app(settings, store, clock), raise_server_exceptions=False) as client:
        yield client, token
    store.close()


@pytest.fixture
def roomy(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    yield from client_with(tmp_path, 300.0)


@pytest.fixture
def hurried(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    yield from client_with(tmp_path, 0.001)


def test_a_preview_at_a_million_dollars_an_hour_completes(roomy: tuple[TestClient, str]) -> None:
    client, token = roomy
    headers = {"Authorization": f"Bearer {token}"}
    assert client.post("/v1/apps", json=rm2(1e6), headers=headers).status_code == 201
    response = client.post("/v1/apps/rm2/plans", json={"rate_qps": 60.0}, headers=headers)
    assert response.status_code == 201, response.text
    plan = response.json()
    assert plan["feasible"] and plan["cost_usd_per_hr"] < 10.0  # 60 qps needs little


def test_a_preview_past_its_deadline_is_a_one_line_422(hurried: tuple[TestClient, str]) -> None:
    client, token = hurried
    headers = {"Authorization": f"Bearer {token}"}
    assert client.post("/v1/apps", json=rm2(1e6), headers=headers).status_code == 201
    response = client.post("/v1/apps/rm2/plans", json={"rate_qps": 60.0}, headers=headers)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "unplannable" and "deadline" in error["message"]
    assert "\n" not in error["message"]
    # Nothing was stored, and the app is as it was.
    listed = client.get("/v1/apps/rm2/plans", headers=headers).json()
    assert listed == [] or listed.get("plans", []) == []


def test_the_kairos_search_stops_at_its_deadline_or_when_cancelled() -> None:
    profiles = load_profiles(SAMPLES)
    prices = {"g4dn.xlarge": 0.526, "c5n.2xlarge": 0.432, "r5n.large": 0.149, "t3.xlarge": 0.1664}
    q = kairos_quantities(
        profiles,
        "rm2",
        TYPES,
        prices,
        350.0,
        (np.array([10, 100, 1000]), np.array([0.5, 0.3, 0.2])),
    )
    late = pytest.raises(deadline.PlanningDeadlineError, match=r"deadline of 0\.05 s")
    with late, deadline.limit(0.05):
        rank_configurations(q, 1e6, {}, 5_000)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(deadline.PlanningCancelledError), deadline.limit(None, cancelled):
        rank_configurations(q, 1e6, {}, 5_000)
    # Outside a limit nothing is checked: a small ranking runs as ever.
    assert len(rank_configurations(q, 5.0, {}, 10)) == 10


def test_a_budget_past_any_fleet_stops_at_the_deadline_without_listing_its_counts() -> None:
    # 1e12 USD/hr affords 10^12-10^13 instances of a type: the search once listed every count
    # range (or every multiple of its chunk) before checking the deadline, gigabytes at once.
    profiles = load_profiles(SAMPLES)
    prices = {"g4dn.xlarge": 0.526, "c5n.2xlarge": 0.432, "r5n.large": 0.149, "t3.xlarge": 0.1664}
    q = kairos_quantities(profiles, "rm2", TYPES, prices, 350.0, (np.array([100]), np.array([1.0])))
    with pytest.raises(deadline.PlanningDeadlineError), deadline.limit(0.5):
        rank_configurations(q, 1e12, {}, 5_000)
