"""``heteroplane serve`` as a real process serves the Open Inference Protocol over gRPC next to
REST: on the setting's port, live and ready to ``tritonclient.grpc``; gone after SIGTERM, with
exit status 0 and the port free again; a gRPC port asked for that is in use is a one-line error
and exit status 2, no traceback; the default port in use is a warning (REST alone); the
setting ``grpc_enabled: false`` or ``--no-grpc`` serves no gRPC.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli.output import UsageError
from controlplane.cli.serve import grpc_address
from controlplane.settings import Settings
from tests.integration.conftest import free_port
from tests.integration.test_serve import REPO, Server, service_env

grpcclient = pytest.importorskip("tritonclient.grpc")


def _refused(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_serve_runs_grpc_beside_rest_and_stops_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    port = free_port()
    server = Server(data_dir, tmp_path / "serve.log", grpc_port=str(port))
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_live() and client.is_server_ready()
            assert client.get_server_metadata().name == "heteroplane"
        finally:
            client.close()
    finally:
        status = server.stop()
    assert status == 0, (tmp_path / "serve.log").read_text()
    log = (tmp_path / "serve.log").read_text()
    assert f"Open Inference Protocol over gRPC on 127.0.0.1:{port}" in log
    assert "Traceback" not in log
    assert _refused(port)


def test_serve_refuses_a_grpc_port_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "controlplane", "serve", "--port", str(free_port())]
        done = subprocess.run(
            [*command, "--grpc-port", str(port)],
            cwd=REPO,
            env=service_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"heteroplane serve: cannot listen on 127.0.0.1:{port}")


def test_where_grpc_is_served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """:func:`~controlplane.cli.serve.grpc_address`: off by the setting or ``--no-grpc``; the
    port asked for, or the setting's; the default port in use is a warning, not an error."""
    settings = Settings(data_dir=tmp_path)
    assert grpc_address(settings, "127.0.0.1", 0) == ("127.0.0.1", 0)
    assert grpc_address(settings, "127.0.0.1", 0, enabled=False) is None
    off = Settings(data_dir=tmp_path, grpc_enabled=False)
    assert grpc_address(off, "127.0.0.1", 0) is None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port}"):
            grpc_address(settings, "127.0.0.1", port)
        with pytest.raises(UsageError):
            grpc_address(Settings(data_dir=tmp_path, grpc_port=port), "127.0.0.1")
        default = Settings(data_dir=tmp_path)
        object.__setattr__(default, "grpc_port", port)  # the default, not a value given
        assert "grpc_port" not in default.model_fields_set
        assert grpc_address(default, "127.0.0.1") is None
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text and "no gRPC served" in caplog.text
