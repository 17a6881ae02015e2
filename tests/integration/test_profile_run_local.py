"""A profile run through real worker processes: the local provisioner starts a worker agent per
type with a registered ONNX artifact (``--artifact``), the run times OIP v2 batches through it,
stores the profiles and stops the workers (controlplane.apps.profile_run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.local_service import family_onnx
from controlplane.apps.profile_run import ProfileRunRequest, run_profile
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import SystemClock
from controlplane.db.store import Store
from provisioners.artifacts import FAMILY_SIGNATURE, file_sha256
from provisioners.local import LocalProvisioner

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TYPES = ("local.cpu", "emu.cpu.small")


@pytest.fixture
def provisioner(tmp_path: Path) -> Iterator[LocalProvisioner]:
    made = LocalProvisioner(
        tmp_path / "workers",
        {"local.cpu": 1.0, "emu.cpu.small": 0.5},
        ["tiny"],
        tmp_path / "cache",
        start_timeout_s=180,
    )
    yield made
    made.terminate([r.provider_id for r in made.records()])
    made.close()


def test_a_profile_run_through_real_workers(tmp_path: Path, provisioner: LocalProvisioner) -> None:
    path = family_onnx(tmp_path / "clf.onnx")
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", SystemClock(), upgrade=True)
    try:
        store.add_model_version(
            "clf",
            1,
            "onnx",
            file_sha256(path),
            path.stat().st_size,
            FAMILY_SIGNATURE,
            path.resolve().as_uri(),
        )
        resolver = AppResolver(
            tmp_path, artifacts=store.get_model_version, measured=store.get_app_profiles
        )
        document = {
            "name": "clf-app",
            "models": [{"name": "clf", "artifact": "clf"}],
            "slo": {"latency_ms": 500},
            "budget_usd_per_hr": 10,
            "instance_types": list(TYPES),
            "max_counts": {"local.cpu": 2},
        }
        store.create_app(spec_document(resolver.check(document).spec), who="test")
        said: list[str] = []
        result = run_profile(
            store,
            resolver,
            provisioner,
            SystemClock(),
            "clf-app",
            ProfileRunRequest(batch_sizes=(1, 8), samples=3, warmup=1),
            who="test",
            worker_port=8080,
            start_timeout_s=180,
            progress=said.append,
        )
        assert [(p.model, p.instance_type) for p in result.profiles] == [("clf", t) for t in TYPES]
        for profile in result.profiles:
            assert all(cell.size == 3 and (cell > 0).all() for cell in profile.samples_ms)
        assert any("ready at 127.0.0.1:" in line for line in said)
        resolved = resolver.resolve(store.get_app("clf-app").spec)
        assert not resolved.unprofiled
        live = [i for i in provisioner.list({}) if i.state in ("pending", "running")]
        assert live == []
    finally:
        store.close()
