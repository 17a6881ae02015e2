"""The pure parts of the request limits: the count of unauthenticated connections
(:class:`~controlplane.service.protocol.ConnectionGuard`: past its limit the least recently
active goes), the JSON nesting check that runs before a body is decoded
(:func:`~controlplane.api.limits.json_depth_exceeds`), and the settings they come from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from controlplane.api.limits import MAX_JSON_DEPTH, json_depth_exceeds
from controlplane.errors import SettingsError
from controlplane.service.protocol import ConnectionGuard, ConnectionLimits, server_options
from controlplane.settings import Settings


class Connection:
    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def test_past_the_limit_the_least_recently_active_connection_goes() -> None:
    guard = ConnectionGuard(3)
    a, b, c, d, e = (Connection(n) for n in "abcde")
    for connection in (a, b, c):
        guard.admit(connection)
    guard.touch(a)  # answered a request: now the most recent
    guard.admit(d)
    assert [x.evicted for x in (a, b, c, d)] == [False, True, False, False]
    guard.forget(c)  # showed a token (or closed): out of the count
    guard.admit(e)
    assert not any(x.evicted for x in (a, c, d, e)) and len(guard) == 3
    assert guard.evicted == 1


def test_a_forgotten_connection_is_never_evicted_or_touched_back() -> None:
    guard = ConnectionGuard(1)
    kept, newer = Connection("kept"), Connection("newer")
    guard.admit(kept)
    guard.forget(kept)
    guard.touch(kept)  # no effect once forgotten
    guard.admit(newer)
    assert not kept.evicted and len(guard) == 1


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (b"[" * 100_000 + b"]" * 100_000, True),
        (b'{"inputs": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", True),
        (json.dumps({"data": [[[[1.5] * 32] * 32] * 3] * 256}).encode(), False),
        # Brackets inside strings, escaped quotes and backslashes included, do not nest.
        (json.dumps({"id": "[" * 1000, "x": ['\\"[[[[' * 100, "\\" * 7]}).encode(), False),
        (b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, False),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), True),
        (b"", False),
    ],
    ids=["100k", "nested-field", "images", "strings", "at-the-limit", "one-past", "empty"],
)
def test_json_depth_is_counted_without_decoding(body: bytes, deep: bool) -> None:
    assert json_depth_exceeds(body) is deep


def test_the_limits_come_from_the_settings() -> None:
    settings = Settings(
        http_head_timeout_s=2.5,
        http_head_max_bytes=16384,
        http_body_min_rate_bytes_per_s=0,
        http_body_rate_window_s=3,
        http_unauthenticated_connections_max=7,
        http_keep_alive_s=90,
    )
    limits = ConnectionLimits.from_settings(settings)
    assert limits == ConnectionLimits(2.5, 16384, 0.0, 3.0, 7, 90.0)
    assert ConnectionLimits.from_settings(Settings()) == ConnectionLimits()
    assert server_options(limits)["timeout_keep_alive"] == 90.0
    for bad in (
        {"http_head_timeout_s": 0},
        {"http_head_max_bytes": 100},
        {"http_keep_alive_s": 0},
        {"http_keep_alive_s": float("inf")},
    ):
        with pytest.raises((SettingsError, ValueError)):
            Settings(**bad)  # type: ignore[arg-type]


def test_the_server_keeps_idle_connections_longer_than_an_alb_does() -> None:
    """An ALB keeps its connections to the service for its idle timeout (60 s unless set;
    terraform's aws_lb sets it): the service's keep-alive must outlast it, or the service closes
    a connection the load balancer is about to send a query on (a 502 to the client)."""
    terraform = Path(__file__).parents[2] / "terraform" / "modules" / "heteroplane"
    (idle,) = re.findall(r"idle_timeout\s*=\s*(\d+)", (terraform / "load_balancer.tf").read_text())
    assert ConnectionLimits().keep_alive_s > int(idle) >= 1
