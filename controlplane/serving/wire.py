"""What the serving process tells the loops process, as JSON: the statuses of the apps it serves
and their serving windows (docs/service.md, "Serving apart from the loops").

When ``heteroplane serve --role serving`` and ``--role loops`` run apart, the loops read what the
serving loop measures over its internal routes (:mod:`controlplane.api.routes.internal`); these
functions turn an :class:`~controlplane.serving.dispatcher.AppStatus` and a
:class:`~controlplane.serving.observations.WindowSummary` into plain JSON values and back, so the
two sides share one definition of the shape (no pickling across processes).

>>> summary = WindowSummary(2.0, 4, 10.0, 20.0, 30.0, 0.75, refused=1)
>>> window_from_json(window_to_json(summary)) == summary
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus
from controlplane.serving.observations import WindowSummary
from controlplane.serving.states import ModelState, Overload

__all__ = ["status_from_json", "status_to_json", "window_from_json", "window_to_json"]

# A stage's fields: one a newer serving process sends that this release does not know is left out.
_STAGE_FIELDS = frozenset(f.name for f in dataclasses.fields(StageStatus))
_OVERLOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(Overload))


def status_to_json(status: AppStatus) -> dict[str, Any]:
    """An app's status as a JSON object (every field, nested ones as objects)."""
    return dataclasses.asdict(status)


def status_from_json(found: dict[str, Any]) -> AppStatus:
    """The :class:`AppStatus` that :func:`status_to_json` wrote."""
    stages = []
    known = _STAGE_FIELDS
    for stage in found["stages"]:
        overload = stage.get("overload")
        stages.append(
            StageStatus(
                **{
                    **{k: v for k, v in stage.items() if k in known},
                    "states": {k: cast(ModelState, v) for k, v in stage["states"].items()},
                    "overload": (
                        Overload(**{k: v for k, v in overload.items() if k in _OVERLOAD_FIELDS})
                        if overload is not None
                        else None
                    ),
                }
            )
        )
    return AppStatus(
        **{
            **found,
            "workers": tuple(WorkerStatus(**w) for w in found["workers"]),
            "stages": tuple(stages),
        }
    )


def window_to_json(window: WindowSummary) -> dict[str, Any]:
    """A serving window as a JSON object."""
    return dataclasses.asdict(window)


def window_from_json(found: dict[str, Any]) -> WindowSummary:
    """The :class:`WindowSummary` that :func:`window_to_json` wrote."""
    return WindowSummary(**found)
