"""``heteroplane model push|list|show`` against a tiny fake registry API (``http.server`` in a
thread on 127.0.0.1) that keeps every request: what each command sends (the raw file bytes as
``application/octet-stream``, the query, the token), what it prints (human and ``--json``), and
that a missing file, a bad name or reference and every API error are one line and exit status 2.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import main

TOKEN = "hp_operator-token"
SHA = "0123456789abcdef" * 4


def version(number: int) -> dict[str, Any]:
    return {
        "name": "wine",
        "version": number,
        "format": "onnx",
        "sha256": SHA,
        "size_bytes": 1537,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
        "uri": f"file:///data/registry/models/wine/{number}/{SHA}.onnx",
        "created_at": "2026-01-01T00:00:00Z",
    }


NOT_FOUND = {"error": {"code": "not_found", "message": "no model 'ghost'", "field": None}}
REJECTED = {
    "error": {
        "code": "invalid_model",
        "message": "the artifact is not an ONNX model onnxruntime can load",
        "field": None,
    }
}
ROUTES: dict[tuple[str, str], tuple[int, Any]] = {
    ("POST", "/v1/models/wine"): (201, version(2)),
    ("POST", "/v1/models/junk"): (422, REJECTED),
    ("GET", "/v1/models"): (200, {"models": [version(1), version(2)]}),
    ("GET", "/v1/models/wine"): (200, {"name": "wine", "versions": [version(1), version(2)]}),
    ("GET", "/v1/models/wine/versions/1"): (200, version(1)),
    ("GET", "/v1/models/ghost"): (404, NOT_FOUND),
}


class FakeRegistry:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.models: list[dict[str, Any]] | None = None
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                path, _, query = self.path.partition("?")
                service.requests.append(
                    {
                        "method": self.command,
                        "path": path,
                        "query": query,
                        "authorization": self.headers.get("Authorization"),
                        "content_type": self.headers.get("Content-Type"),
                        "body": self.rfile.read(length),
                    }
                )
                status, body = ROUTES.get((self.command, path), (404, NOT_FOUND))
                if path == "/v1/models" and service.models is not None:
                    body = {"models": service.models}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRegistry]:
    service = FakeRegistry()
    monkeypatch.setenv("HETEROPLANE_URL", service.url)
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    yield service
    service.close()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_push_streams_the_file(
    fake: FakeRegistry, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    content = bytes(range(256)) * 100
    model = tmp_path / "wine.onnx"
    model.write_bytes(content)
    status, out, err = cli(capsys, "model", "push", "wine", str(model), "--format", "onnx")
    assert (status, err) == (0, "")
    assert out.strip() == (
        "pushed wine@2: onnx, 1,537 bytes, sha256 0123456789ab...;"
        " inputs input FP32[-1,13]; outputs logits FP32[-1,3]"
    )
    sent = fake.requests[-1]
    assert (sent["method"], sent["path"], sent["query"]) == (
        "POST",
        "/v1/models/wine",
        "format=onnx",
    )
    assert sent["content_type"] == "application/octet-stream"
    assert sent["authorization"] == f"Bearer {TOKEN}"
    assert sent["body"] == content

    status, out, _ = cli(
        capsys, "model", "push", "wine", str(model), "--inputs", "input:FP32:-1x13", "--json"
    )
    assert status == 0 and json.loads(out) == version(2)
    assert fake.requests[-1]["query"] == "inputs=input%3AFP32%3A-1x13"


def test_list_and_show(fake: FakeRegistry, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = cli(capsys, "model", "list")
    lines = out.splitlines()
    assert status == 0 and lines[0].split()[:4] == ["MODEL", "VERSION", "FORMAT", "SIZE_BYTES"]
    assert [line.split()[:2] for line in lines[1:]] == [["wine", "1"], ["wine", "2"]]
    status, out, _ = cli(capsys, "model", "list", "--json")
    assert json.loads(out) == {"models": [version(1), version(2)]}
    fake.models = []
    status, out, _ = cli(capsys, "model", "list")
    assert (status, out.strip()) == (0, "no models")

    status, out, _ = cli(capsys, "model", "show", "wine")
    assert status == 0 and "newest: wine@2" in out and f"sha256:     {SHA}" in out
    status, out, _ = cli(capsys, "model", "show", "wine@1", "--json")
    assert status == 0 and json.loads(out) == version(1)
    assert fake.requests[-1]["path"] == "/v1/models/wine/versions/1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["model", "push", "wine", "{missing}"],
            "heteroplane model: no model file at {missing}",
        ),
        (
            ["model", "push", "Wine", "{file}"],
            "heteroplane model: model name 'Wine' is not a DNS label: 1 to 63 lower-case"
            " letters, digits and '-', starting and ending with a letter or digit",
        ),
        (
            ["model", "push", "junk", "{file}"],
            "heteroplane model: the artifact is not an ONNX model onnxruntime can load"
            " (HTTP 422 invalid_model)",
        ),
        (
            ["model", "show", "ghost"],
            "heteroplane model: no model 'ghost' (HTTP 404 not_found)",
        ),
        (
            ["model", "show", "wine@x"],
            "heteroplane model: model reference 'wine@x': expected NAME or NAME@VERSION",
        ),
        (
            ["model", "show", "wine@1\n"],
            "heteroplane model: model reference 'wine@1\\n': expected NAME or NAME@VERSION",
        ),
        (
            ["model", "push", "wine", "{file}", "--format", "pickle"],
            "heteroplane model push: argument --format: invalid choice: 'pickle'",
        ),
    ],
)
def test_failures_are_one_line_and_status_2(
    fake: FakeRegistry,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    message: str,
) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"bytes")
    names = {"missing": str(tmp_path / "nope.onnx"), "file": str(model)}
    status, out, err = cli(capsys, *(a.format(**names) for a in argv))
    assert (status, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(**names))
