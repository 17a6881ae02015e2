"""The registry's tables on both databases (a SQLite file and a throwaway PostgreSQL server):
versions, a lost race for a version number (the unique constraint, a 409 to retry), concurrent
pushes from threads that each get their own version, and an app's profiles deleted with it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.clock import FakeClock
from controlplane.db.store import ModelVersionRecord, Store
from controlplane.errors import ConflictError
from controlplane.registry import LocalArtifactStorage, Registry
from tests.component.test_registry import SIGNATURE, blobs, fake_inspector

SHA = "cd" * 32


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    store = Store.from_url(database_url, FakeClock(), upgrade=True)
    yield store
    store.close()


def test_versions_and_a_lost_race(store: Store) -> None:
    store.add_model_version("wine", 1, "onnx", SHA, 1, SIGNATURE, "file:///r/1.onnx")
    with pytest.raises(ConflictError):
        store.add_model_version("wine", 1, "onnx", SHA, 1, SIGNATURE, "file:///r/1b.onnx")
    # The failed insert left the store usable and the first row alone.
    assert store.next_model_version("wine") == 2
    assert store.get_model_version("wine").uri == "file:///r/1.onnx"


def test_concurrent_pushes(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "registry"
    registry = Registry(
        store, LocalArtifactStorage(root), staging_dir=root / "in", inspector=fake_inspector()
    )
    files = []
    for i in range(8):
        path = tmp_path / f"m{i}.onnx"
        path.write_bytes(f"model {i}".encode())
        files.append(path)
    pushed: list[ModelVersionRecord] = []
    lost: list[ConflictError] = []
    barrier = threading.Barrier(len(files))

    def push(path: Path) -> None:
        barrier.wait()
        try:
            pushed.append(registry.push("wine", path))
        except ConflictError as error:
            lost.append(error)

    threads = [threading.Thread(target=push, args=(path,)) for path in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(pushed) + len(lost) == len(files) and len(pushed) >= 2
    assert sorted(r.version for r in pushed) == list(range(1, len(pushed) + 1))
    assert len(blobs(root / "models")) == len(pushed)


def test_profiles_go_with_their_app(store: Store) -> None:
    app = {
        "name": "toy",
        "models": [{"name": "m", "artifact": "wine"}],
        "slo": {"latency_ms": 40},
        "budget_usd_per_hr": 1.0,
        "instance_types": ["c5.xlarge"],
    }
    store.create_app(app, who="test")
    store.put_app_profiles("toy", {"profiles": [{"model": "m"}]})
    assert store.get_app_profiles("toy") == {"profiles": [{"model": "m"}]}
    store.delete_app("toy")
    store.create_app(app, who="test")
    assert store.get_app_profiles("toy") is None
