"""The model registry: the store's model tables, :class:`Registry` over the local blob store, the
inspection subprocess and ``/v1/models`` through FastAPI's TestClient, on a SQLite file migrated
through the real migrations.

Most tests inject a fake inspector (the registry's seam); the inspection subprocess is driven
with a stub inspector module (refusal, crash, hang, garbage) and, where helper module
``provisioners.worker.inspect`` is present, with the real one on a real ONNX file. What is
checked besides the happy paths: versions count up per name, also under concurrent pushes; a
failure after the blob was stored leaves no blob and no row; every refusal is one line and a 4xx.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from controlplane.clock import FakeClock
from controlplane.db.store import ModelVersionRecord, Store
from controlplane.errors import (
    ConflictError,
    InvalidValueError,
    ModelNameError,
    ModelRejectedError,
    ModelTooLargeError,
    NotFoundError,
)
from controlplane.registry import (
    Inspection,
    LocalArtifactStorage,
    Registry,
    SubprocessInspector,
    artifact_key,
    inspect_artifact,
    inspect_kept,
    parse_reference,
    registry_from_settings,
)
from controlplane.registry.inspection import (
    end_orphaned_inspectors,
    inspector_command,
    running_inspectors,
)
from controlplane.registry.registry import STAGING_PREFIX
from controlplane.service.app import create_app
from controlplane.settings import Settings
from provisioners.artifacts import ArtifactRef, ModelSignature, TensorSpec, file_sha256
from provisioners.fetch import fetch_artifact
from provisioners.storage import held

SIGNATURE = ModelSignature(
    (TensorSpec("input", "FP32", (-1, 4)),), (TensorSpec("logits", "FP32", (-1, 3)),)
)
SHA = "ab" * 32


def fake_inspector(
    signature: ModelSignature = SIGNATURE,
) -> Any:
    """An inspector that takes any file whose bytes do not start with ``bad`` as ONNX."""
    calls: list[tuple[Path, str | None, str | None]] = []

    def inspect(path: Path, format: str | None = None, inputs: str | None = None) -> Inspection:
        calls.append((path, format, inputs))
        if path.read_bytes().startswith(b"bad"):
            raise ModelRejectedError("the artifact is not an ONNX model (fake)")
        return Inspection(format or "onnx", signature)

    inspect.calls = calls  # type: ignore[attr-defined]
    return inspect


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    settings = Settings(data_dir=tmp_path / "data", provisioner="fake")
    settings.ensure_data_dir()
    store = Store.from_url(settings.database_url, FakeClock(), upgrade=True)
    yield store
    store.close()


@pytest.fixture
def registry(store: Store, tmp_path: Path) -> Registry:
    root = tmp_path / "data" / "registry"
    return Registry(
        store,
        LocalArtifactStorage(root),
        staging_dir=root / "incoming",
        max_bytes=1000,
        inspector=fake_inspector(),
    )


def model_file(folder: Path, content: bytes = b"model bytes", name: str = "m.onnx") -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


def blobs(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# --- the store ---------------------------------------------------------------------------------


def test_store_model_versions(store: Store) -> None:
    assert store.next_model_version("wine") == 1
    first = store.add_model_version("wine", 1, "onnx", SHA, 10, SIGNATURE, "file:///x/1.onnx")
    assert store.next_model_version("wine") == 2
    store.add_model_version("wine", 2, "torchscript", SHA, 11, SIGNATURE, "s3://b/models/w/2.pt")
    store.add_model_version("beer", 1, "onnx", SHA, 12, SIGNATURE, "file:///x/b.onnx")
    assert first.signature == SIGNATURE and first.created_at.tzinfo is not None
    assert [(r.name, r.version) for r in store.list_model_versions()] == [
        ("beer", 1),
        ("wine", 1),
        ("wine", 2),
    ]
    assert [r.version for r in store.list_model_versions("wine")] == [1, 2]
    assert store.list_model_versions("ghost") == []
    assert store.get_model_version("wine").version == 2
    assert store.get_model_version("wine", 1) == first
    with pytest.raises(NotFoundError, match="wine@7"):
        store.get_model_version("wine", 7)
    with pytest.raises(NotFoundError, match="ghost"):
        store.get_model_version("ghost")
    with pytest.raises(ConflictError, match="version 2"):
        store.add_model_version("wine", 2, "onnx", SHA, 10, SIGNATURE, "file:///x/2.onnx")


@pytest.mark.parametrize(
    ("name", "version", "fmt", "sha", "size", "uri"),
    [
        ("Wine", 1, "onnx", SHA, 1, "file:///x"),
        ("wine", 0, "onnx", SHA, 1, "file:///x"),
        ("wine", 1, "pickle", SHA, 1, "file:///x"),
        ("wine", 1, "onnx", "xyz", 1, "file:///x"),
        ("wine", 1, "onnx", SHA, -1, "file:///x"),
        ("wine", 1, "onnx", SHA, 1, "http://x"),
    ],
)
def test_store_refuses_bad_versions(
    store: Store, name: str, version: int, fmt: str, sha: str, size: int, uri: str
) -> None:
    with pytest.raises(InvalidValueError):
        store.add_model_version(name, version, fmt, sha, size, SIGNATURE, uri)
    assert store.list_model_versions() == []


def test_record_json_and_ref(store: Store) -> None:
    record = store.add_model_version("wine", 1, "onnx", SHA, 10, SIGNATURE, "file:///x/1.onnx")
    document = record.to_json()
    assert set(document) == {
        "name",
        "version",
        "format",
        "sha256",
        "size_bytes",
        "inputs",
        "outputs",
        "uri",
        "created_at",
    }
    assert document["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    assert document["created_at"].endswith("Z")
    assert record.ref("classifier") == ArtifactRef(
        "classifier", "wine", 1, "onnx", SHA, "file:///x/1.onnx"
    )


def test_app_profiles(store: Store) -> None:
    app = {
        "name": "toy",
        "models": [{"name": "m", "artifact": "wine@1"}],
        "slo": {"latency_ms": 40},
        "budget_usd_per_hr": 4.0,
        "instance_types": ["c5.xlarge"],
    }
    store.create_app(app, who="test")
    assert store.get_app_profiles("toy") is None
    assert store.get_app_profiles("ghost") is None
    store.put_app_profiles("toy", {"profiles": [{"model": "m", "samples_ms": [1.0]}]})
    store.put_app_profiles("toy", {"profiles": [{"model": "m", "samples_ms": [2.0]}]})
    assert store.get_app_profiles("toy") == {"profiles": [{"model": "m", "samples_ms": [2.0]}]}
    with pytest.raises(NotFoundError):
        store.put_app_profiles("ghost", {})
    with pytest.raises(InvalidValueError):
        store.put_app_profiles("toy", {"x": float("nan")})
    # Deleting the app deletes its profiles (ON DELETE CASCADE); a new app of that name has none.
    store.delete_app("toy")
    store.create_app(app, who="test")
    assert store.get_app_profiles("toy") is None


# --- the registry ------------------------------------------------------------------------------


def test_push_counts_versions_and_stores_blobs(registry: Registry, tmp_path: Path) -> None:
    content = b"model bytes"
    first = registry.push("wine", model_file(tmp_path, content))
    second = registry.push("wine", model_file(tmp_path, content + b"!"), "onnx")
    other = registry.push("beer", model_file(tmp_path, content))
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert first.sha256 == hashlib.sha256(content).hexdigest()
    assert first.size_bytes == len(content)
    assert first.signature == SIGNATURE and first.format == "onnx"
    root = tmp_path / "data" / "registry"
    assert first.uri == (root / "models" / "wine" / "1" / f"{first.sha256}.onnx").as_uri()
    assert fetch_artifact(first.ref("wine"), tmp_path / "cache").read_bytes() == content
    assert b"".join(registry.open(second)) == content + b"!"
    assert registry.resolve("wine") == second
    assert registry.resolve("wine@1") == first
    assert [r.version for r in registry.versions("wine")] == [1, 2]
    # The source is only read; nothing is left in the staging folder.
    assert (tmp_path / "m.onnx").exists()
    assert not list((root / "incoming").glob("*")) if (root / "incoming").exists() else True


def test_artifact_key_and_references() -> None:
    assert artifact_key("wine", 3, SHA, "onnx") == f"wine/3/{SHA}.onnx"
    assert artifact_key("wine", 3, SHA, "torchscript") == f"wine/3/{SHA}.pt"
    assert parse_reference("wine") == ("wine", None)
    assert parse_reference("wine@12") == ("wine", 12)
    # A trailing newline passed the pattern's "$" (re.match), and "wine\n" was a name.
    for bad in ("Wine", "wine@", "wine@x", "wine@0", "@3", "", "a@1@2", "-x", "wine\n", "w@1\n"):
        with pytest.raises(ModelNameError):
            parse_reference(bad)


@pytest.mark.parametrize(
    "name", ["Wine", "wine_1", "-wine", "wine-", "a" * 64, "", "a/b", "é", "wine\n"]
)
def test_push_refuses_bad_names(registry: Registry, tmp_path: Path, name: str) -> None:
    with pytest.raises(ModelNameError, match="DNS label") as caught:
        registry.push(name, model_file(tmp_path))
    assert "\n" not in str(caught.value)
    assert registry.versions() == []


def test_push_refusals_write_nothing(registry: Registry, tmp_path: Path) -> None:
    root = tmp_path / "data" / "registry"
    with pytest.raises(ModelTooLargeError, match="1,000 bytes"):
        registry.push("wine", model_file(tmp_path, b"x" * 1001))
    with pytest.raises(ModelRejectedError, match="empty"):
        registry.push("wine", model_file(tmp_path, b""))
    with pytest.raises(ModelRejectedError, match="fake"):
        registry.push("wine", model_file(tmp_path, b"bad model"))
    with pytest.raises(ModelRejectedError, match="cannot read"):
        registry.push("wine", tmp_path / "missing.onnx")
    with pytest.raises(ModelRejectedError, match="format 'pickle'"):
        registry.push("wine", model_file(tmp_path), "pickle")
    with pytest.raises(ModelRejectedError, match="control characters"):
        registry.push("wine", model_file(tmp_path), "torchscript", "x\x00:FP32:-1x4")
    assert registry.versions() == []
    assert blobs(root) == []


@pytest.mark.parametrize(
    ("shape", "refusal"),
    [
        ((1, 4), "input 'input' has shape \\[1, 4\\]: heteroplane batches"),
        # A sample of no values: pushed, profiled and planned, and no /v1 query could reach it.
        ((-1, 0), "input 'input' has shape \\[-1, 0\\]: a sample of no values cannot be queried"),
    ],
)
def test_push_refuses_inputs_it_cannot_batch_or_query(
    store: Store, tmp_path: Path, shape: tuple[int, ...], refusal: str
) -> None:
    signature = ModelSignature(
        (TensorSpec("input", "FP32", shape),), (TensorSpec("logits", "FP32", (-1, 3)),)
    )
    root = tmp_path / "registry"
    registry = Registry(
        store, LocalArtifactStorage(root), staging_dir=root, inspector=fake_inspector(signature)
    )
    with pytest.raises(ModelRejectedError, match=refusal):
        registry.push("wine", model_file(tmp_path))
    assert store.list_model_versions() == [] and blobs(root) == []


def test_a_failed_insert_removes_the_blob(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> ModelVersionRecord:
        raise InvalidValueError("model", "refused (test)")

    monkeypatch.setattr(registry.store, "add_model_version", broken)
    with pytest.raises(InvalidValueError):
        registry.push("wine", model_file(tmp_path))
    assert blobs(tmp_path / "data" / "registry") == []
    monkeypatch.undo()
    assert registry.store.list_model_versions() == []


def test_a_lost_race_retries_once_with_the_next_version(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another push takes version 1 between this push's choice of 1 and its insert: this one
    removes its blob and takes 2. Losing twice is a 409 with no blob of its own left."""
    store = registry.store
    real_next = store.next_model_version
    other = model_file(tmp_path, b"the other push", "other.onnx")

    def stale(name: str) -> int:
        number = real_next(name)
        # The other push wins this number (its blob, then its row), after this one chose it.
        sha = hashlib.sha256(other.read_bytes()).hexdigest()
        uri = registry.storage.put(other, artifact_key(name, number, sha, "onnx"))
        store.add_model_version(name, number, "onnx", sha, 14, SIGNATURE, uri)
        return number

    monkeypatch.setattr(store, "next_model_version", stale)
    with pytest.raises(ConflictError):
        registry.push("wine", model_file(tmp_path, b"mine"))
    monkeypatch.undo()
    versions = store.list_model_versions("wine")
    assert [v.version for v in versions] == [1, 2]
    assert {b.read_bytes() for b in blobs(tmp_path / "data" / "registry")} == {b"the other push"}

    calls = {"n": 0}

    def stale_once(name: str) -> int:
        calls["n"] += 1
        return real_next(name) - (1 if calls["n"] == 1 else 0)

    monkeypatch.setattr(store, "next_model_version", stale_once)
    record = registry.push("wine", model_file(tmp_path, b"mine"))
    assert record.version == 3
    assert b"".join(registry.open(record)) == b"mine"
    assert len(blobs(tmp_path / "data" / "registry")) == 3


def test_the_same_file_racing_for_one_version_keeps_the_winners_blob(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another push of the same file takes version 1 after this one found no version and chose
    1 (while it stores its blob): this one keeps the winner's blob (the same key) and answers
    the winner's version."""
    storage = registry.storage
    real_put = storage.put
    same = model_file(tmp_path, b"same bytes")
    won: list[ModelVersionRecord] = []

    def overtaken(source: Path, key: str) -> str:
        if not won:
            monkeypatch.setattr(storage, "put", real_put)
            won.append(registry.push("wine", same))
        return real_put(source, key)

    monkeypatch.setattr(storage, "put", overtaken)
    answer = registry.push_version("wine", same)
    assert answer == (won[0], False) and won[0].version == 1
    assert [v.version for v in registry.store.list_model_versions("wine")] == [1]
    assert b"".join(registry.open(won[0])) == b"same bytes"
    assert len(blobs(tmp_path / "data" / "registry")) == 1


def test_the_same_file_pushed_before_this_push_chose_its_number_is_answered(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another push of the same file takes version 1 after this one found no version but before
    it chose its number: this one answers version 1 (no version 2 of the same bytes)."""
    store = registry.store
    real_next = store.next_model_version
    same = model_file(tmp_path, b"same bytes")
    won: list[ModelVersionRecord] = []

    def overtaken_first(name: str) -> int:
        if not won:
            monkeypatch.setattr(store, "next_model_version", real_next)
            won.append(registry.push(name, same))
        return real_next(name)

    monkeypatch.setattr(store, "next_model_version", overtaken_first)
    answer = registry.push_version("wine", same)
    assert answer == (won[0], False)
    assert [v.version for v in store.list_model_versions("wine")] == [1]
    assert len(blobs(tmp_path / "data" / "registry")) == 1


def test_a_push_of_the_newest_versions_file_answers_that_version(
    store: Store, tmp_path: Path
) -> None:
    """The README's own-model block run twice pushed the same wine.onnx as version 2, and its
    `app apply` of `artifact: wine` was refused (a live app changes version by a rollout). The
    newest version's file, format and signature again are that version; anything else is a new
    one, the same file after another version too."""

    def inspect(
        path: Path, format: str | None = None, inputs_spec: str | None = None
    ) -> Inspection:
        if inputs_spec is None:
            return Inspection(format or "onnx", SIGNATURE)
        # Another inputs spec of the same TorchScript archive: another signature.
        wide = ModelSignature((TensorSpec("input", "FP32", (-1, 8)),), SIGNATURE.outputs)
        return Inspection("torchscript", wide)

    root = tmp_path / "registry"
    registry = Registry(store, LocalArtifactStorage(root), staging_dir=root, inspector=inspect)
    wine = model_file(tmp_path, b"wine bytes")
    first = registry.push_version("wine", wine)
    assert first.created and first.record.version == 1
    again = registry.push_version("wine", model_file(tmp_path, b"wine bytes", "copy.onnx"))
    assert again == (first.record, False)
    assert registry.push("wine", wine, "onnx") == first.record
    assert [v.version for v in store.list_model_versions("wine")] == [1]
    assert len(blobs(root)) == 1
    # Another format, other inputs, other bytes: new versions; then the first file again is
    # one too, its newest version being another file.
    assert registry.push_version("wine", wine, "torchscript") == (registry.resolve("wine"), True)
    inputs = registry.push_version("wine", wine, "torchscript", "input:FP32:-1x8")
    assert inputs.created and inputs.record.version == 3
    assert registry.push_version("wine", wine, "torchscript", "input:FP32:-1x8").created is False
    other = registry.push_version("wine", model_file(tmp_path, b"other bytes", "other.onnx"))
    assert other.created and other.record.version == 4
    back = registry.push_version("wine", wine)
    assert back.created and back.record.version == 5
    # Under another name the same file is that name's first version.
    assert registry.push_version("beer", wine) == (registry.resolve("beer@1"), True)


def test_concurrent_pushes_get_distinct_versions(registry: Registry, tmp_path: Path) -> None:
    files = [model_file(tmp_path, f"model {i}".encode(), f"m{i}.onnx") for i in range(6)]
    results: list[ModelVersionRecord] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(files))

    def push(path: Path) -> None:
        barrier.wait()
        try:
            results.append(registry.push("wine", path))
        except ConflictError as error:  # lost twice: allowed, and leaves nothing behind
            failures.append(error)

    threads = [threading.Thread(target=push, args=(f,)) for f in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    versions = sorted(r.version for r in results)
    assert versions == list(range(1, len(results) + 1))
    assert len(results) + len(failures) == len(files) and len(results) >= 2
    stored = blobs(tmp_path / "data" / "registry" / "models")
    assert len(stored) == len(results)
    for record in results:
        assert hashlib.sha256(b"".join(registry.open(record))).hexdigest() == record.sha256


def test_registry_from_settings_stores_in_the_data_directory(store: Store, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", provisioner="fake", model_max_bytes=123)
    registry = registry_from_settings(settings, store)
    assert isinstance(registry.storage, LocalArtifactStorage)
    assert registry.storage.root == (tmp_path / "data" / "registry").resolve()
    assert registry.max_bytes == 123
    assert isinstance(registry.inspector, SubprocessInspector)


def test_local_storage_refuses_foreign_uris(tmp_path: Path) -> None:
    from controlplane.errors import ArtifactStoreError

    storage = LocalArtifactStorage(tmp_path / "registry")
    with pytest.raises(ArtifactStoreError):
        storage.delete((tmp_path / "elsewhere.onnx").as_uri())
    with pytest.raises(ArtifactStoreError):
        storage.open("s3://bucket/models/x")
    with pytest.raises(ArtifactStoreError):
        storage.put(model_file(tmp_path), "../../escape.onnx")
    storage.delete((tmp_path / "registry" / "models" / "gone.onnx").as_uri())  # idempotent


# --- the inspection subprocess -----------------------------------------------------------------

STUB = textwrap.dedent(
    """
    import json, sys, time
    path = sys.argv[1]
    what = open(path, "rb").read().decode()
    if what == "ok":
        print(json.dumps({"format": "onnx", "inputs": [{"name": "x", "datatype": "FP32",
              "shape": [-1, 2]}], "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1]}]}))
        print(" ".join(sys.argv[2:]), file=sys.stderr)
    elif what == "refuse":
        print(f"{path} is not a model (stub)", file=sys.stderr)
        sys.exit(2)
    elif what == "hang":
        time.sleep(30)
    elif what == "spin":  # a forward that never returns
        while True:
            pass
    elif what == "crash":
        raise RuntimeError("boom")
    elif what == "memory":
        blob = bytearray(1 << 33)
    elif what == "garbage":
        print("not json")
    """
)


@pytest.fixture
def stub_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = tmp_path / "stubs"
    folder.mkdir()
    (folder / "stub_inspect.py").write_text(STUB)
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return "stub_inspect"


def test_inspection_reads_the_answer(stub_module: str, tmp_path: Path) -> None:
    found = inspect_artifact(model_file(tmp_path, b"ok"), "onnx", "x:FP32:-1x2", module=stub_module)
    assert found.format == "onnx"
    assert found.signature.inputs == (TensorSpec("x", "FP32", (-1, 2)),)
    assert found.signature.outputs == (TensorSpec("y", "INT64", (-1,)),)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("refuse", r"^the artifact is not a model \(stub\)$"),
        ("crash", r"^cannot inspect the model: the inspector failed with status 1: RuntimeError"),
        ("memory", r"more memory than the inspector's limit"),
    ],
)
def test_inspection_refusals_are_one_line(
    stub_module: str, tmp_path: Path, content: str, message: str
) -> None:
    with pytest.raises(ModelRejectedError, match=message) as caught:
        inspect_artifact(
            model_file(tmp_path, content.encode()), module=stub_module, memory_bytes=1 << 30
        )
    assert "\n" not in str(caught.value)
    assert str(tmp_path) not in str(caught.value)


def test_inspection_times_out(stub_module: str, tmp_path: Path) -> None:
    inspector = SubprocessInspector(timeout_s=1.0, module=stub_module)
    with pytest.raises(ModelRejectedError, match="longer than 1 s"):
        inspector(model_file(tmp_path, b"hang"))


def test_an_inspection_that_succeeded_is_kept_for_the_same_bytes_asked_the_same_way(
    stub_module: str, tmp_path: Path
) -> None:
    inspector = SubprocessInspector(module=stub_module)

    def kept(by: SubprocessInspector, path: Path, *asked: str) -> Inspection:
        return inspect_kept(by, path, file_sha256(path), *asked)

    first = kept(inspector, model_file(tmp_path, b"ok"), "onnx")
    # From here on the inspector refuses everything: what is answered was kept.
    refusing = "import sys; print('refused (stub)', file=sys.stderr); sys.exit(2)"
    (tmp_path / "stubs" / "stub_inspect.py").write_text(refusing)
    (tmp_path / "elsewhere").mkdir()
    same_bytes = model_file(tmp_path / "elsewhere", b"ok", name="other.onnx")
    assert kept(inspector, same_bytes, "onnx") == first
    for asked_otherwise in (
        lambda: kept(inspector, same_bytes, "onnx", "x:FP32:-1x2"),
        lambda: kept(inspector, same_bytes),
        lambda: kept(SubprocessInspector(timeout_s=30.0, module=stub_module), same_bytes, "onnx"),
        lambda: kept(inspector, model_file(tmp_path / "elsewhere", b"ok!"), "onnx"),
    ):
        with pytest.raises(ModelRejectedError, match="refused"):
            asked_otherwise()


def test_a_refusal_is_not_kept(stub_module: str, tmp_path: Path) -> None:
    inspector = SubprocessInspector(module=stub_module)
    path = model_file(tmp_path, b"refuse")
    with pytest.raises(ModelRejectedError, match="not a model"):
        inspect_kept(inspector, path, file_sha256(path), "onnx")
    answering = STUB.replace('what == "ok"', 'what == "refuse"')
    (tmp_path / "stubs" / "stub_inspect.py").write_text(answering)
    assert inspect_kept(inspector, path, file_sha256(path), "onnx").format == "onnx"


def inspectors_of(owner: int) -> list[int]:
    """The pids of the inspectors ``owner`` started (by their marker)."""
    return [pid for pid, started_by, _ in running_inspectors() if started_by == owner]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


@needs_proc
def test_an_inspector_dies_with_its_parent(stub_module: str, tmp_path: Path) -> None:
    spinning = model_file(tmp_path, b"spin")
    script = (
        "import sys; from pathlib import Path;"
        " from controlplane.registry.inspection import inspect_artifact;"
        f" inspect_artifact(Path(sys.argv[1]), module={stub_module!r}, timeout_s=600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(spinning)])
    try:
        assert wait_until(lambda: len(inspectors_of(parent.pid)) == 1), "no inspector started"
        (child,) = inspectors_of(parent.pid)
        parent.kill()  # SIGKILL: the parent's limits and timeout die with it
        parent.wait()
        assert wait_until(lambda: not alive(child)), f"inspector {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        for pid in inspectors_of(parent.pid):
            os.kill(pid, signal.SIGKILL)


@needs_proc
def test_an_inspector_stops_at_its_own_cpu_limit(stub_module: str, tmp_path: Path) -> None:
    command = inspector_command(
        sys.executable,
        stub_module,
        [str(model_file(tmp_path, b"spin"))],
        memory_bytes=1 << 30,
        cpu_s=1,
    )
    child = subprocess.Popen(command, env={**os.environ}, start_new_session=True)
    try:
        returncode = child.wait(timeout=60)
    finally:
        child.kill()
    assert returncode in (-signal.SIGXCPU, -signal.SIGKILL)


@needs_proc
def test_inspectors_left_by_a_dead_service_are_ended_at_start(
    stub_module: str, tmp_path: Path
) -> None:
    spinning = [str(model_file(tmp_path, b"spin"))]
    me = (os.getpid(), int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]))
    # One whose owner is gone (a start time that is not this process's), one of this live one.
    orphan_command = inspector_command(
        sys.executable, stub_module, spinning, memory_bytes=1 << 30, cpu_s=60, owner=(me[0], 1)
    )
    owned_command = inspector_command(
        sys.executable, stub_module, spinning, memory_bytes=1 << 30, cpu_s=60, owner=me
    )
    orphan = subprocess.Popen(orphan_command, start_new_session=True)
    owned = subprocess.Popen(owned_command, start_new_session=True)
    try:
        # Popen returns once the command is exec'd: both carry their marker now.
        ended = end_orphaned_inspectors()
        # (Another service starting on this machine meanwhile may have ended the orphan first.)
        assert orphan.pid in ended or orphan.poll() is not None
        assert owned.pid not in ended
        assert orphan.wait(timeout=20) == -signal.SIGKILL
        assert owned.poll() is None
    finally:
        for child in (orphan, owned):
            child.kill()
            child.wait()


def test_an_answer_that_breaks_the_contract_is_a_bug(stub_module: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not an inspection"):
        inspect_artifact(model_file(tmp_path, b"garbage"), module=stub_module)


needs_inspector = pytest.mark.skipif(
    importlib.util.find_spec("provisioners.worker.inspect") is None
    or importlib.util.find_spec("onnx") is None,
    reason="provisioners.worker.inspect (the worker's inspector) or onnx is not installed",
)


def onnx_model(path: Path, batch: str | int = "batch") -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    weights = helper.make_tensor(
        "W", TensorProto.FLOAT, [4, 3], np.ones((4, 3), np.float32).ravel().tolist()
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 3])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@needs_inspector
def test_push_with_the_real_inspector(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "registry"
    registry = Registry(store, LocalArtifactStorage(root), staging_dir=root / "incoming")
    record = registry.push("wine", onnx_model(tmp_path / "wine.onnx"))
    assert record.format == "onnx"
    assert record.signature == SIGNATURE
    with pytest.raises(ModelRejectedError) as caught:
        registry.push("wine", model_file(tmp_path, b"definitely not a model"))
    assert "\n" not in str(caught.value)
    with pytest.raises(ModelRejectedError, match="dynamic"):
        registry.push("fixed", onnx_model(tmp_path / "fixed.onnx", batch=1))
    assert [r.version for r in store.list_model_versions()] == [1]
    assert len(blobs(root)) == 1


@needs_inspector
def test_an_onnx_model_with_external_data_is_refused_without_the_servers_paths(
    store: Store, tmp_path: Path
) -> None:
    import onnx
    from onnx import numpy_helper

    source = onnx.load(str(onnx_model(tmp_path / "inline.onnx")))
    weights = source.graph.initializer[0]  # as raw bytes: only those go to an external file
    weights.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights), weights.name))
    split = tmp_path / "split.onnx"
    onnx.save_model(
        source, str(split), save_as_external_data=True, location="split.onnx.data", size_threshold=0
    )
    root = tmp_path / "registry"
    registry = Registry(store, LocalArtifactStorage(root), staging_dir=root / "incoming")
    # As the API does: the upload (the .onnx alone) is staged, then pushed. onnxruntime looked
    # for the weights beside the staged copy, and the refusal named the service's folders
    # ('External data path does not exist: "/srv/.../registry/incoming/split.onnx.data"'),
    # not what to do.
    with (
        registry.staged_file() as staged,
        pytest.raises(ModelRejectedError, match="external data") as caught,
    ):
        staged.write_bytes(split.read_bytes())
        registry.push("split", staged)
    message = str(caught.value)
    assert str(tmp_path) not in message and "save_as_external_data=False" in message
    assert store.list_model_versions() == [] and blobs(root) == []


# --- the API -----------------------------------------------------------------------------------


@dataclass
class Api:
    client: TestClient
    store: Store
    tokens: dict[str, str]
    data_dir: Path

    def call(
        self, method: str, url: str, scope: str | None = "operator", **kwargs: Any
    ) -> httpx.Response:
        headers = {**kwargs.pop("headers", {})}
        if scope is not None:
            headers["Authorization"] = f"Bearer {self.tokens[scope]}"
        response: httpx.Response = self.client.request(method, url, headers=headers, **kwargs)
        return response


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir, provisioner="fake", model_max_bytes=2 << 20)
    settings.ensure_data_dir()
    store = Store.from_url(settings.database_url, FakeClock(), upgrade=True)
    tokens = {s: store.create_token(s, name=f"{s}-token") for s in ("operator", "viewer", "infer")}
    registry = registry_from_settings(settings, store, inspector=fake_inspector())
    app = create_app(settings, store, FakeClock(), registry=registry)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Api(client, store, tokens, data_dir)
    store.close()


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    message: str = error["message"]
    assert message and "\n" not in message
    return message


def test_api_push_list_show_download(api: Api) -> None:
    content = b"m" * (1 << 20) + b"tail"  # over the API's usual 1 MiB body limit
    pushed = api.call("POST", "/v1/models/wine?format=onnx", content=content)
    assert pushed.status_code == 201, pushed.text
    version = pushed.json()
    assert version["name"] == "wine" and version["version"] == 1
    assert version["sha256"] == hashlib.sha256(content).hexdigest()
    assert version["size_bytes"] == len(content)
    assert version["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    assert version["uri"].startswith("file:///") and version["uri"].endswith(".onnx")
    assert version["created"] is True
    again = api.call("POST", "/v1/models/wine", content=b"second")
    assert again.status_code == 201 and again.json()["version"] == 2

    listing = api.call("GET", "/v1/models", "viewer")
    assert listing.status_code == 200
    assert [(v["name"], v["version"]) for v in listing.json()["models"]] == [
        ("wine", 1),
        ("wine", 2),
    ]
    model = api.call("GET", "/v1/models/wine", "viewer").json()
    assert model["name"] == "wine" and [v["version"] for v in model["versions"]] == [1, 2]
    one = api.call("GET", "/v1/models/wine/versions/1", "viewer")
    assert one.status_code == 200 and one.json() | {"created": True} == version
    artifact = api.call("GET", "/v1/models/wine/versions/1/artifact", "viewer")
    assert artifact.status_code == 200
    assert artifact.headers["content-type"] == "application/octet-stream"
    assert artifact.content == content
    assert api.store.get_model_version("wine").version == 2


def test_api_push_of_the_newest_versions_file_answers_it_with_200(api: Api) -> None:
    """A push run twice (the README's own-model block) answers the version the first made:
    200, ``created`` false, no new version, no new blob."""
    first = api.call("POST", "/v1/models/wine", content=b"wine bytes")
    assert first.status_code == 201 and first.json()["created"] is True
    again = api.call("POST", "/v1/models/wine?format=onnx", content=b"wine bytes")
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "created": False}
    assert [v.version for v in api.store.list_model_versions("wine")] == [1]
    assert len(blobs(api.data_dir / "registry" / "models")) == 1
    other = api.call("POST", "/v1/models/wine", content=b"other bytes")
    assert other.status_code == 201 and other.json()["version"] == 2
    assert other.json()["created"] is True


def test_api_refusals_are_one_line_4xx(api: Api) -> None:
    assert_error(api.call("POST", "/v1/models/Wine", content=b"x"), 400, "invalid_model_name")
    # Stored as "nl\n", its blob under a folder of that name, before the name was matched whole.
    assert_error(api.call("POST", "/v1/models/nl%0A", content=b"x"), 400, "invalid_model_name")
    assert_error(api.call("GET", "/v1/models/Wine", "viewer"), 400, "invalid_model_name")
    assert_error(api.call("POST", "/v1/models/wine", content=b"bad"), 422, "invalid_model")
    assert_error(api.call("POST", "/v1/models/wine", content=b""), 422, "invalid_model")
    assert_error(
        api.call("POST", "/v1/models/wine?format=pickle", content=b"x"), 422, "invalid_request"
    )
    # A TorchScript model's inputs spec is checked before the upload is read: a malformed one,
    # or one with a NUL byte (which no inspector's command line can carry), is the user's 422.
    for spec in ("%00", "x%00:FP32:-1x4", "input:FP32"):
        pushed = api.call("POST", f"/v1/models/wine?inputs={spec}", content=b"x")
        # Named as the query parameter it came in, not the command line's option.
        message = assert_error(pushed, 422, "invalid_model")
        assert message.startswith("inputs ") and "--inputs" not in message
        assert pushed.json()["error"]["field"] == "inputs"
    # The artifact itself at fault names no parameter.
    assert api.call("POST", "/v1/models/wine", content=b"bad").json()["error"]["field"] is None
    assert_error(api.call("GET", "/v1/models/ghost", "viewer"), 404, "not_found")
    assert_error(api.call("GET", "/v1/models/ghost/versions/1", "viewer"), 404, "not_found")
    assert_error(
        api.call("GET", "/v1/models/ghost/versions/1/artifact", "viewer"), 404, "not_found"
    )
    assert_error(api.call("GET", "/v1/models/ghost/versions/0", "viewer"), 422, "invalid_request")
    assert_error(api.call("POST", "/v1/models/wine", "viewer", content=b"x"), 403, "forbidden")
    assert_error(api.call("POST", "/v1/models/wine", "infer", content=b"x"), 403, "forbidden")
    assert_error(api.call("GET", "/v1/models", "infer"), 403, "forbidden")
    assert_error(api.call("POST", "/v1/models/wine", None, content=b"x"), 401, "unauthorized")
    assert api.store.list_model_versions() == []
    assert blobs(api.data_dir / "registry") == []


def test_api_too_large_leaves_nothing_behind(api: Api) -> None:
    big = b"x" * ((2 << 20) + 1)
    message = assert_error(api.call("POST", "/v1/models/wine", content=big), 413, "too_large")
    assert "2,097,152 bytes" in message

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b"x" * (1 << 20)

    assert_error(api.call("POST", "/v1/models/wine", content=chunked()), 413, "too_large")
    assert api.store.list_model_versions() == []
    assert blobs(api.data_dir / "registry") == []


def test_openapi_documents_the_routes(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    push = document["paths"]["/v1/models/{name}"]["post"]
    assert "application/octet-stream" in push["requestBody"]["content"]
    assert {"200", "201", "400", "413", "422"} <= set(push["responses"])
    artifact = document["paths"]["/v1/models/{name}/versions/{version}/artifact"]["get"]
    assert "application/octet-stream" in artifact["responses"]["200"]["content"]


# --- staging: removed on any failure, swept at start --------------------------------------------


def test_a_staged_upload_is_held_while_in_use_and_removed_on_failure(registry: Registry) -> None:
    with pytest.raises(RuntimeError), registry.staged_file() as path:
        path.write_bytes(b"half an upload")
        assert held(path)  # this process holds it: a sweep leaves it alone
        assert registry.sweep() == []
        assert path.exists()
        raise RuntimeError("the client went away")
    assert not path.exists()
    assert list(registry.staging_dir.iterdir()) == []


def test_the_sweep_removes_what_a_crashed_push_left(registry: Registry, tmp_path: Path) -> None:
    kept = registry.push("wine", model_file(tmp_path))
    root = tmp_path / "data" / "registry"
    # What a push killed at each step leaves: a staged upload, a blob store temporary file, a
    # blob stored but without its row (no process holds any of them any more).
    registry.staging_dir.mkdir(parents=True)
    staged = registry.staging_dir / f"{STAGING_PREFIX}crashed"
    staged.write_bytes(b"x" * 100)
    temporary = root / "models" / "wine" / "2" / ".incoming-crashed"
    temporary.parent.mkdir(parents=True)
    temporary.write_bytes(b"y")
    rowless = root / "models" / "wine" / "2" / ("ab" * 32 + ".onnx")
    rowless.write_bytes(b"z")
    # A push in flight (held) keeps its file and holds back the sweep of blobs without a row.
    with registry.staged_file() as in_flight:
        removed = registry.sweep()
        assert sorted(removed) == sorted([str(staged), str(temporary)])
        assert in_flight.exists() and rowless.exists()
    removed = registry.sweep()
    assert removed == [str(rowless)]
    assert [p for p in blobs(root) if "incoming" not in p.parts] == [
        Path(kept.uri.removeprefix("file://"))
    ]
    assert not rowless.parent.exists()  # its empty folder went with it
    assert registry.store.get_model_version("wine").uri == kept.uri


def test_the_service_sweeps_the_staging_folder_as_it_starts(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir, provisioner="fake")
    settings.ensure_data_dir()
    store = Store.from_url(settings.database_url, FakeClock(), upgrade=True)
    registry = registry_from_settings(settings, store, inspector=fake_inspector())
    registry.staging_dir.mkdir(parents=True)
    leftover = registry.staging_dir / f"{STAGING_PREFIX}from-before-the-crash"
    leftover.write_bytes(b"x" * 1000)
    app = create_app(settings, store, FakeClock(), registry=registry)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/healthz").status_code == 200
        assert not leftover.exists()
    store.close()
