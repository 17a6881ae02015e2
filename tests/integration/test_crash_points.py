"""The crash-point harness in CI: ``heteroplane serve`` (SQLite, local provisioner) SIGKILLs itself
at a named point (``HETEROPLANE_CRASH_AT``, controlplane.crashpoints) of a long operation, is
started again, and nothing is left behind: no worker without a row, no row without its worker, no
profile worker of a dead run, no spend past the budget, no staged upload or inspector; the
operation is done or cleanly not done, and running it again works.

A few points, one per kind of guarantee (each a service started twice, seconds): a push killed
between its blob and its row, a profile run killed with its workers launched, a reconciler killed
between a launch and its row's update, a rollout's handover killed between writing which old
instances end and ending them (the service started again ends them and finishes the handover).
``benchmarks/crash_points.py`` runs every point.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.crash_points import run_point, table
from tests.serve_forks import popen

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.mark.parametrize(
    ("point", "operation"),
    [
        ("model_push.before_row", "model push"),
        ("profile_run.after_launch", "profile run"),
        ("reconcile.after_launch", "plan apply"),
        # A whole rollout after the app's start (its profile run, two steps, a handover).
        pytest.param("rollout.handover_recorded", "rollout", marks=pytest.mark.slow),
    ],
)
def test_a_crash_at_the_point_leaves_nothing_behind(
    point: str, operation: str, tmp_path: Path
) -> None:
    # The services forked from a process that has imported the service (tests/serve_forks.py).
    result = run_point(point, tmp_path, finish=False, launch=popen)
    report = table([result])
    assert result.error == "", report
    assert result.operation == operation, report
    assert result.checks.orphans == [] and result.checks.rowless == [], report
    assert result.checks.stale == [] and result.checks.leftovers == [], report
    assert result.checks.excess_usd_per_hr == 0.0, report
    assert result.outcome in ("done", "not done"), report
    assert result.redo == "ok", report
