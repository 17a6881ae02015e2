"""The model registry end to end: ``heteroplane serve`` as a real process (uvicorn on a loopback
port, the real inspector in its subprocess), ``heteroplane model push|list|show`` against it, and
the artifact downloaded back. A push over ``model_max_bytes`` (declared, so refused before the
body is read) and a file that is not a model are one line and exit status 2, and leave nothing
in the registry's folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.component.test_registry import onnx_model
from tests.integration.test_serve import Server, cli, create_token

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("provisioners.worker.inspect") is None
    or importlib.util.find_spec("onnx") is None,
    reason="provisioners.worker.inspect (the worker's inspector) or onnx is not installed",
)

MAX_BYTES = 64 << 10


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Server, Path]]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    token = create_token(data_dir, "operator", "pusher")
    server = Server(data_dir, tmp_path / "serve.log", model_max_bytes=str(MAX_BYTES))
    monkeypatch.setenv("HETEROPLANE_URL", server.url)
    monkeypatch.setenv("HETEROPLANE_TOKEN", token)
    yield server, data_dir
    assert server.stop() == 0, server.log_path.read_text()


def registry_files(data_dir: Path) -> list[Path]:
    return sorted(p for p in (data_dir / "registry").rglob("*") if p.is_file())


def test_push_list_show_download(
    served: tuple[Server, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, data_dir = served
    model = onnx_model(tmp_path / "wine.onnx")
    status, out, err = cli(capsys, "model", "push", "wine", str(model), "--json")
    assert status == 0, err
    version = json.loads(out)
    assert (version["name"], version["version"], version["format"]) == ("wine", 1, "onnx")
    assert version["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert version["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]

    # The same file again (the README's own-model block run twice): its version, no new one.
    status, out, _ = cli(capsys, "model", "push", "wine", str(model))
    assert status == 0 and out.startswith("unchanged wine@1: onnx,")
    assert "its newest version holds this file already" in out
    status, out, _ = cli(capsys, "model", "push", "wine", str(model), "--json")
    assert status == 0 and json.loads(out) == {**version, "created": False}
    other = onnx_model(tmp_path / "other.onnx", batch="n")  # other bytes, the same signature
    status, out, _ = cli(capsys, "model", "push", "wine", str(other))
    assert status == 0 and out.startswith("pushed wine@2: onnx,")
    status, out, _ = cli(capsys, "model", "list")
    assert status == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["wine", "1"],
        ["wine", "2"],
    ]
    status, out, _ = cli(capsys, "model", "show", "wine@1", "--json")
    assert status == 0 and json.loads(out) | {"created": True} == version

    token = httpx.Headers({"Authorization": f"Bearer {create_token(data_dir, 'viewer', 'v')}"})
    artifact = httpx.get(f"{server.url}/v1/models/wine/versions/1/artifact", headers=token)
    assert artifact.status_code == 200 and artifact.content == model.read_bytes()

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    status, out, err = cli(capsys, "model", "push", "junk", str(junk))
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == 1 and "(HTTP 422 invalid_model)" in err
    assert "upload-" not in err and str(data_dir) not in err

    big = tmp_path / "big.onnx"
    big.write_bytes(b"\0" * (MAX_BYTES + 1))
    status, out, err = cli(capsys, "model", "push", "big", str(big))
    assert (status, out) == (2, "")
    assert len(err.splitlines()) == 1 and "(HTTP 413 too_large)" in err

    # Two versions' blobs, nothing staged, nothing of the refused pushes.
    assert [p.parent.parent.name for p in registry_files(data_dir)] == ["wine", "wine"]
