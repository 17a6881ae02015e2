"""A query of an app whose rollout moves traffic (docs/rollouts.md): on the old version, on the
new one, or on the old one with a shadow copy on the new one.

- **Canary step**: the query goes to the new version when its request id falls in the step's
  share (:func:`controlplane.policies.rollout.routed_to_new`), else to the old one. A query the
  new version fails (no worker yet, every attempt failed, overloaded, timed out) counts as an
  error of the new version and is answered by the old one: moving traffic loses no query.
- **Shadow step**: the query goes to both at once; the client gets the old version's answer;
  when both have answered, their outputs are compared sample by sample (the class each
  predicts) and the new one's is discarded.

Each answer is measured at the client's view (``total_ms``, from the API's receipt of the
request) into the loop's :class:`~controlplane.serving.versions.VersionMeter`, per version.
A query the new version answers is also the app's demand (its arrival time in the app's
arrivals, which the tuner, the gear switcher and the re-plan read), not in the old version's
figures.
A query refused for its own inputs (422) is the client's error, no version's, where both
versions refuse it. A query the new version refuses and the old one answers is the new
version's error (a version that raises on inputs the old one serves): in a canary step the old
version's answer goes to the client, in a shadow step it had already; where the old version
refuses it too, the client gets the old version's 422 and no version is counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from controlplane.errors import QueryRejectedError, ServingError
from controlplane.policies.rollout import routed_to_new
from controlplane.serving.dispatcher import InferResult
from controlplane.serving.modelio import Row
from controlplane.serving.observations import CLIENT_ERRORS
from controlplane.serving.versions import CanaryRoute

if TYPE_CHECKING:
    from controlplane.serving.loop import ServingLoop

__all__ = ["split_infer"]

logger = logging.getLogger(__name__)


async def split_infer(
    loop: ServingLoop,
    app: str,
    route: CanaryRoute,
    request_id: str,
    inputs: Sequence[Row],
    sample_ids: list[int] | None,
    received: float,
    deadline_s: float | None,
) -> InferResult:
    """Answer a query of ``app`` under ``route`` (module docstring)."""
    if route.shadow:
        shadow = asyncio.get_running_loop().create_task(
            _on_new(loop, app, route, inputs, None, received, None)
        )
        try:
            result = await _on_old(loop, app, route, inputs, sample_ids, received, deadline_s)
        except BaseException:
            shadow.add_done_callback(_quiet)
            raise
        compare = asyncio.get_running_loop().create_task(_compare(loop, app, route, result, shadow))
        loop._background.add(compare)
        compare.add_done_callback(loop._background.discard)
        return result
    if routed_to_new(request_id, route.share):
        try:
            answer = await _on_new(loop, app, route, inputs, sample_ids, received, deadline_s)
        except QueryRejectedError:
            # The old version's answer says whose error it is: its own 422 (the inputs) is
            # raised to the client uncounted; an answer makes it the new version's.
            result = await _on_old(loop, app, route, inputs, sample_ids, received, deadline_s)
            loop.versions.failed(app, route, route.new_version)
            return result
        if answer is not None:
            # The app's demand is every query of it: the tuner sizes the fleet the queries
            # come back to (a roll-back, the handover's end) on it.
            loop.observations.demand(app, loop.clock.now_s())
            return answer
        # The new version failed it: the old one answers (counted as the new version's error).
    return await _on_old(loop, app, route, inputs, sample_ids, received, deadline_s)


async def _on_old(
    loop: ServingLoop,
    app: str,
    route: CanaryRoute,
    inputs: Sequence[Row],
    sample_ids: list[int] | None,
    received: float,
    deadline_s: float | None,
) -> InferResult:
    try:
        result = await loop.infer_on_spec_version(
            app, inputs, sample_ids, None, received, deadline_s
        )
    except CLIENT_ERRORS:
        raise
    except ServingError:
        loop.versions.failed(app, route, route.old_version)
        raise
    labelled, correct = _labelled(loop, app, result, sample_ids)
    loop.versions.answered(app, route, route.old_version, result.total_ms, labelled, correct)
    return result


async def _on_new(
    loop: ServingLoop,
    app: str,
    route: CanaryRoute,
    inputs: Sequence[Row],
    sample_ids: list[int] | None,
    received: float,
    deadline_s: float | None,
) -> InferResult | None:
    """The new version's answer, or None when it failed (counted)."""
    try:
        dispatcher = await loop.canary(app, route)
        result = await dispatcher.infer(inputs, sample_ids, None, received, deadline_s)
    except CLIENT_ERRORS:
        raise
    except ServingError as error:
        logger.debug("%s: the new version failed a query: %s", app, error)
        loop.versions.failed(app, route, route.new_version)
        return None
    labelled, correct = _labelled(loop, app, result, sample_ids)
    loop.versions.answered(app, route, route.new_version, result.total_ms, labelled, correct)
    return result


def _labelled(
    loop: ServingLoop, app: str, result: InferResult, sample_ids: list[int] | None
) -> tuple[int, int]:
    """(samples with a validation sample id, of them answered with its label): the version's
    accuracy where labels come with the app's validation records."""
    if sample_ids is None:
        return 0, 0
    dispatcher = loop.served(app)
    records = dispatcher.config.validation if dispatcher is not None else None
    if records is None:
        return 0, 0
    labels = records.labels
    labelled = correct = 0
    for output, sample in zip(result.outputs, sample_ids, strict=False):
        if 0 <= sample < labels.size:
            labelled += 1
            correct += int(output == int(labels[sample]))
    return labelled, correct


async def _compare(
    loop: ServingLoop,
    app: str,
    route: CanaryRoute,
    old: InferResult,
    shadow: asyncio.Task[InferResult | None],
) -> None:
    try:
        new = await shadow
    except QueryRejectedError:  # inputs the old version answered: the new version's error
        loop.versions.failed(app, route, route.new_version)
        return
    except Exception:  # nothing the new version is to blame for (a requirement unmet)
        return
    if new is None:
        return
    agreed = sum(1 for a, b in zip(old.outputs, new.outputs, strict=False) if a == b)
    loop.versions.compared(app, route, route.new_version, len(old.outputs), agreed)


def _quiet(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()
