"""The API's log of database errors is thinned (controlplane.api.errors): a database that went
down was an ERROR line for each request, 25 a second from a loops process's feed alone."""

from __future__ import annotations

import logging

import pytest

from controlplane.api import errors


def test_a_run_of_errors_is_one_line_then_one_with_the_count_left_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(errors.time, "monotonic", lambda: now[0])
    thinned = errors._Thinned(every_s=10.0)
    with caplog.at_level(logging.ERROR, logger=errors.logger.name):
        for _ in range(25):
            thinned.log("database error on POST /internal/v1/feed: down")
        now[0] += 10.0
        thinned.log("database error on GET /v1/apps: down")
    assert [r.getMessage() for r in caplog.records] == [
        "database error on POST /internal/v1/feed: down",
        "database error on GET /v1/apps: down (24 more since the last such line)",
    ]
