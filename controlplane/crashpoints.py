"""Named crash points: a test-only hook that lets the crash-point harness
(``tests/integration/test_crash_points.py``, ``benchmarks/crash_points.py``) kill the service at a
chosen point of a long operation, deterministically.

:func:`crash_point` is a no-op unless the environment variable :data:`CRASH_AT_ENV`
(``HETEROPLANE_CRASH_AT``) names the point (or one of a comma-separated list): then the process
SIGKILLs itself there, as ``kill -9`` from outside would, leaving no chance to clean up. The
points (docs/operations.md, "Crash guarantees"):

>>> sorted(POINTS)[:3]
['app_down.after_mark', 'budget.after_change', 'model_push.after_row']
>>> crash_point("model_push.after_row")  # not set: nothing happens
"""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["CRASH_AT_ENV", "POINTS", "crash_point", "crash_with"]

CRASH_AT_ENV = "HETEROPLANE_CRASH_AT"

POINTS = frozenset(
    {
        "model_push.mid_upload",
        "model_push.before_row",
        "model_push.after_row",
        "profile_run.after_row",
        "profile_run.after_launch",
        "profile_run.measuring",
        "plan_apply.after_apply",
        "reconcile.after_row",
        "reconcile.after_launch",
        "reconcile.before_terminate",
        "budget.after_change",
        "app_down.after_mark",
        "rollout.after_start",
        "rollout.after_profile",
        "rollout.after_worker_row",
        "rollout.after_step",
        "rollout.after_pin",
        "rollout.handover_recorded",
    }
)


# Processes SIGKILLed with this one at a crash point: the serving process of a loops process it
# started (controlplane.cli.loops_process), so that a point in the loops kills the service
# whole, as kill -9 of the service or a lost machine does.
_ALSO: set[int] = set()


def crash_with(pid: int) -> None:
    """Have a crash point of this process SIGKILL ``pid`` too, first."""
    _ALSO.add(pid)


def crash_point(name: str) -> None:
    """SIGKILL this process (and those :func:`crash_with` named) if :data:`CRASH_AT_ENV` names
    ``name`` (a no-op otherwise)."""
    wanted = os.environ.get(CRASH_AT_ENV)
    if not wanted:
        return
    if name in (part.strip() for part in wanted.split(",")):
        for pid in _ALSO:
            with contextlib.suppress(OSError):  # gone already
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
