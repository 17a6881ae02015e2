"""A process that dies writing a decision (or an instance's move), for the tests of what a crash
between a write and the decision that says it leaves: the insert of each row whose reason holds
the next of ``reasons`` fails once (the transaction it is in rolls back, as a SIGKILL there would
leave it uncommitted)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from controlplane.db import models as m


@contextmanager
def decision_write_fails(*reasons: str) -> Iterator[list[str]]:
    """While inside, the insert of a decision whose reason holds ``reasons[0]`` fails (once),
    then of one that holds ``reasons[1]``, and so on; yields what is left to fail."""
    with _write_fails(m.DecisionRow, reasons) as failing:
        yield failing


@contextmanager
def instance_move_fails(*reasons: str, after: int = 0) -> Iterator[list[str]]:
    """As :func:`decision_write_fails`, of the ``instance_events`` row an instance's move
    writes (its reason); ``after``: that many moves whose reason holds ``reasons[0]`` are
    written first."""
    with _write_fails(m.InstanceEvent, reasons, after) as failing:
        yield failing


@contextmanager
def _write_fails(model: type[Any], reasons: tuple[str, ...], after: int = 0) -> Iterator[list[str]]:
    failing = list(reasons)
    passed = [after]

    def killed(_mapper: Any, _connection: Any, row: Any) -> None:
        if failing and failing[0] in row.reason:
            if passed[0] > 0:
                passed[0] -= 1
                return
            failing.pop(0)
            raise RuntimeError(f"test: the process died writing the {model.__tablename__} row")

    event.listen(model, "before_insert", killed)
    try:
        yield failing
    finally:
        event.remove(model, "before_insert", killed)
