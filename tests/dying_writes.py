"""A process that dies writing a decision, for the tests of what a crash between a write and
the decision that says it leaves: the insert of each decision whose reason holds the next of
``reasons`` fails once (the transaction it is in rolls back, as a SIGKILL there would leave it
uncommitted)."""

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
    failing = list(reasons)

    def killed(_mapper: Any, _connection: Any, row: m.DecisionRow) -> None:
        if failing and failing[0] in row.reason:
            failing.pop(0)
            raise RuntimeError("test: the process died writing the decision")

    event.listen(m.DecisionRow, "before_insert", killed)
    try:
        yield failing
    finally:
        event.remove(m.DecisionRow, "before_insert", killed)
