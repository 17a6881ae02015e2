"""What the command line imports before a command runs (docs/cli.md, "Start-up").

``heteroplane --help``, every ``heteroplane COMMAND --help`` and the client commands must not
load numpy, the estimator's compiled kernels, the service's frameworks or torch: that is what
keeps them fast (benchmarks/cli_speed.py measures the time; nothing here does). Each check runs
in a fresh interpreter, since this one has imported everything already. Then: every parser names
a handler that exists, and every default copied from a library into the parsers equals its source.
"""

from __future__ import annotations

import argparse
import importlib
import json
import socket
import subprocess
import sys
from typing import Any

import pytest

from controlplane.cli import build_parser
from controlplane.cli.parsers import LIBRARY_COPIES, Handler
from controlplane.errors import SettingsError

# What the parsers and the client commands must not import (each is a package's top module).
HEAVY = (
    "fastapi",
    "sqlalchemy",
    "alembic",
    "uvicorn",
    "torch",
    "numba",
    "scipy",
    "numpy",
    "pydantic",
    "apscheduler",
)

# Prints, as JSON, which of HEAVY (and httpx) the lines before it imported.
_REPORT = """
import json, sys
names = {heavy!r} + ("httpx",)
print(json.dumps(sorted(name for name in names if name in sys.modules)))
"""


def imported_after(code: str) -> list[str]:
    """Which of :data:`HEAVY` and httpx a fresh interpreter has imported after ``code``."""
    script = code + _REPORT.format(heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    names: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return names


def test_building_the_parser_imports_nothing_heavy() -> None:
    assert imported_after("import controlplane.cli as cli\ncli.build_parser()") == []


def test_the_help_of_every_command_imports_nothing_heavy() -> None:
    code = """
import contextlib, io
import controlplane.cli as cli
parser = cli.build_parser()
commands = next(a for a in parser._actions if a.dest == "command").choices
for argv in [["--help"], *([name, "--help"] for name in commands)]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main(argv)
"""
    assert imported_after(code) == []


def test_a_client_command_imports_httpx_and_nothing_heavy() -> None:
    # A port that is bound and not listening refuses the connection: the command fails at once,
    # after importing all it needs to send the request.
    code = """
import contextlib, io, socket
import controlplane.cli as cli
with socket.socket() as closed:
    closed.bind(("127.0.0.1", 0))
    url = "http://127.0.0.1:%d" % closed.getsockname()[1]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            cli.main(["fleet", "--app", "demo", "--url", url, "--token", "t"])
        except SystemExit as stop:
            assert stop.code == 2, stop.code
assert "cannot reach the heteroplane API" in err.getvalue(), err.getvalue()
"""
    assert imported_after(code) == ["httpx"]


def _leaves(parser: argparse.ArgumentParser, path: str = "heteroplane") -> dict[str, Any]:
    """Each command that runs (a parser without actions under it) -> its ``handler`` default."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {path: parser.get_default("handler")}
    found = {}
    for group in groups:
        for name, sub in group.choices.items():
            found |= _leaves(sub, f"{path} {name}")
    return found


def test_every_command_names_a_handler_that_exists() -> None:
    leaves = _leaves(build_parser())
    assert "heteroplane app apply" in leaves and "heteroplane bounds" in leaves
    for command, handler in leaves.items():
        assert isinstance(handler, Handler), command
        module = importlib.import_module(f"controlplane.cli.{handler.module}")
        assert callable(getattr(module, handler.function, None)), command


@pytest.mark.parametrize("source", sorted(LIBRARY_COPIES))
def test_the_parsers_copies_equal_the_libraries(source: str) -> None:
    module, _, name = source.rpartition(".")
    assert getattr(importlib.import_module(module), name) == LIBRARY_COPIES[source]


def test_grpc_on_the_apis_port_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's listener, bound beside the API's socket, failed in the running service, which went
    on serving REST alone with an error in its log."""
    from tests.unit.test_cli_trace import one_line_error

    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("HETEROPLANE_PROVISIONER", "fake")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = one_line_error(capsys, ["serve", "--port", str(port), "--grpc-port", str(port)])
    assert error == (
        f"heteroplane serve: gRPC's port {port} (--grpc-port, or the setting grpc_port) is the"
        " API's port: give gRPC another one (0 picks a free one) or --no-grpc"
    )
    assert not (tmp_path / "heteroplane.db").exists()  # nothing was started


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_database_is_refused_by_serve(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """Migrated on one connection and found "not migrated" on the next, it exited 2 telling to
    run heteroplane db upgrade, which would migrate yet another empty database."""
    from controlplane.service.build import SERVICE_ROLES, build_service
    from controlplane.settings import Settings
    from tests.unit.test_cli_trace import one_line_error

    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", url)
    monkeypatch.setenv("HETEROPLANE_PROVISIONER", "fake")
    for command in ("serve", "demo"):  # the demo before its minutes of training
        error = one_line_error(capsys, [command, "--port", "0"])
        assert error == (
            f"heteroplane {command}: database_url: {url} is an in-memory SQLite database, which"
            " the service cannot run on: every process and connection would see its own empty"
            " database; use a file (sqlite:///PATH, the default under data_dir) or PostgreSQL"
        )
    # The same for every caller of build_service (the demo, one role alone).
    settings = Settings(data_dir=tmp_path, database_url=url, provisioner="fake")
    for role in SERVICE_ROLES:
        with pytest.raises(SettingsError, match="is an in-memory SQLite database"):
            build_service(settings, role=role)
