"""What the service logs of a reconcile tick: its errors' text, not only their count (a launch
retried every 5 s said "3 error(s)" and nothing else)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from controlplane.loops.reconciler import AppReport, ReconcileReport
from controlplane.service.build import _log_report


def test_a_ticks_errors_are_logged_with_their_text(caplog: pytest.LogCaptureFixture) -> None:
    errors = tuple(
        f"launch rm2-{n}: the provider returned no live instance\nmore" for n in range(5)
    )
    report = ReconcileReport(
        at=datetime(2026, 12, 1, tzinfo=UTC),
        apps={"rm2": AppReport("rm2", (), errors), "quiet": AppReport("quiet", ())},
    )
    with caplog.at_level(logging.INFO, logger="controlplane.service.build"):
        _log_report(report)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "reconcile rm2: 0 action(s), 5 error(s)"
    assert lines[1] == (
        "reconcile rm2: launch rm2-0: the provider returned no live instance; launch rm2-1: the"
        " provider returned no live instance; launch rm2-2: the provider returned no live"
        " instance (and 2 more)"
    )
    assert caplog.records[1].levelno == logging.WARNING and len(lines) == 2
