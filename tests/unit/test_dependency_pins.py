"""What the service relies on in its dependencies beyond their public APIs, pinned.

Two such places are left, each because the public API has no way to do what it does:

- ``controlplane.service.protocol`` subclasses uvicorn's HTTP protocol classes
  (``HttpToolsProtocol``, ``H11Protocol``) to bound what one client may hold: uvicorn has no
  hook for a head's size or arrival time, a body's rate, or connections without a token. It
  overrides their callbacks and reads their attributes (below).
- ``controlplane.loops.scheduler.SkippedRunsAtDebug`` recognises APScheduler's warning for a run
  skipped at ``max_instances`` by its text (APScheduler logs it unconditionally; its public
  ``EVENT_JOB_MAX_INSTANCES`` event tells of the skip but cannot quiet the warning).

Each test reads the installed version, checks it lies in the range these were checked on (the
range pyproject.toml allows), and checks that what we use is still there, so an upgrade past the
range fails here, with a name, rather than in a served request. To widen a range: install the
new version, run this file and tests/integration/test_connection_limits.py (the limits against a
real server) and tests/unit/test_scheduler.py, then move the bound here and in pyproject.toml.

The settings' config file source and the worker transport's answer parser use public APIs only
(pydantic-settings' ``PydanticBaseSettingsSource``, httptools' ``HttpResponseParser``); the
scheduler's :class:`~controlplane.loops.scheduler.GuardedJob` is not a copy of APScheduler's
``max_instances=1``: that guards the runs the scheduler starts, the wrapper also a direct call.
"""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version
from typing import Any

import uvicorn
from apscheduler.schedulers.base import BaseScheduler
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from controlplane.loops.scheduler import SkippedRunsAtDebug
from controlplane.service.protocol import HeadLimitedHttpToolsProtocol, server_options
from tests.recording_transport import RecordingTransport

# Checked on uvicorn 0.29.0 and 0.40.0 (their source read for the names below) and 0.54.0 (these
# tests and the limits' integration tests); pyproject.toml: uvicorn>=0.29,<0.55.
UVICORN_CHECKED = ((0, 29), (0, 55))
# Checked on APScheduler 3.10.0 (its source read for the message) and 3.11.3 (these tests and the
# scheduler's); pyproject.toml: apscheduler>=3.10,<3.12.
APSCHEDULER_CHECKED = ((3, 10), (3, 12))


def _within(package: str, checked: tuple[tuple[int, int], tuple[int, int]]) -> None:
    installed = version(package)
    major, minor = (int(part) for part in installed.split(".")[:2])
    low, high = checked
    assert low <= (major, minor) < high, (
        f"{package} {installed} is outside the range {low} <= (major, minor) < {high} that"
        " tests/unit/test_dependency_pins.py was checked on: check it, then widen the range there"
        " and in pyproject.toml"
    )


def test_uvicorn_is_within_the_checked_range_and_has_the_callbacks_we_override() -> None:
    _within("uvicorn", UVICORN_CHECKED)
    overridden = {
        HttpToolsProtocol: [
            "connection_made",
            "connection_lost",
            "data_received",
            "on_headers_complete",
            "on_body",
            "on_message_complete",
            "on_response_complete",
        ],
        H11Protocol: ["data_received", "send_400_response"],
    }
    for cls, names in overridden.items():
        missing = [name for name in names if not callable(getattr(cls, name, None))]
        assert not missing, f"uvicorn's {cls.__name__} lost {missing}"
    assert "msg" in inspect.signature(H11Protocol.send_400_response).parameters
    assert "h11_max_incomplete_event_size" in inspect.signature(uvicorn.Config).parameters


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def test_uvicorns_httptools_protocol_has_the_state_our_limits_read() -> None:
    """The attributes HeadLimitedHttpToolsProtocol reads, on a protocol that took a head whose
    body is still to come (what the body-rate check looks at)."""

    async def take_a_head() -> None:
        config = uvicorn.Config(_app, **server_options())
        config.load()
        assert issubclass(config.http_protocol_class, HeadLimitedHttpToolsProtocol)
        protocol = config.http_protocol_class(
            config=config, server_state=ServerState(), app_state={}
        )
        assert isinstance(protocol, HttpToolsProtocol)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nab")
        assert protocol.loop is asyncio.get_running_loop()
        assert protocol.transport is transport
        assert protocol.url == b"/v1/x"
        assert protocol.flow.read_paused is False
        assert isinstance(protocol.server_state.default_headers, list)
        assert protocol.scope is not None and "extensions" in protocol.scope
        cycle = protocol.cycle
        assert cycle.more_body is True and cycle.response_started is False
        assert cycle.waiting_for_100_continue is False and cycle.disconnected is False
        assert isinstance(cycle.message_event, asyncio.Event)
        protocol.connection_lost(None)
        await asyncio.sleep(0)  # the app's task ends (its receive sees the disconnect)

    asyncio.run(take_a_head())


def test_apscheduler_is_within_the_checked_range_and_words_its_skip_as_the_filter_expects() -> None:
    _within("apscheduler", APSCHEDULER_CHECKED)
    source = inspect.getsource(BaseScheduler._process_jobs)
    assert "maximum number of running " in source and "instances reached" in source, (
        "APScheduler's warning for a run skipped at max_instances changed: update"
        " SkippedRunsAtDebug in controlplane/loops/scheduler.py"
    )
    assert "maximum number of running instances" in inspect.getsource(SkippedRunsAtDebug)
