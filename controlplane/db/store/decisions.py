"""The decision log: what the loops decided and why, keyed decisions merged, its retention."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, or_, select
from sqlalchemy.orm import Session

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _app_row,
    _json_document,
    _label,
    _newest_rows,
    _translated,
)
from controlplane.db.store.records import (
    DecisionRecord,
    _decision_record,
)
from controlplane.errors import InvalidValueError

__all__ = ["DecisionStore", "Keyed", "Words", "add_decision", "add_keyed"]

_DECISION_KEY_MAX = 200

# Decisions (unkeyed) written in the transaction of the write they say, each
# ``(kind, reason, numbers)``: a plan applied (:meth:`PlanStore.apply_plan`'s ``said``).
Words = Sequence[tuple[str, str, Mapping[str, Any]]]
# One keyed decision written so, ``(kind, reason, numbers, key)``: a calibration stored
# (:meth:`CalibrationStore.set_profile_scale`'s ``said``), a launch failed for good
# (:meth:`InstanceStore.transition_instance`'s ``keyed``).
Keyed = tuple[str, str, Mapping[str, Any], str]


def add_decision(
    session: Session,
    app_id: int,
    kind: str,
    reason: str,
    numbers: Mapping[str, Any],
    at: datetime,
    *,
    key: str | None = None,
    merge_window_s: float = 0.0,
) -> m.DecisionRow:
    """A decision of the app ``app_id`` written in ``session``'s transaction: with the write it
    says (a rollout's move, :meth:`RolloutStore.move_rollout`), both or neither. A keyed one
    repeats the row :meth:`DecisionStore.record_decision` says it does (``merge_window_s``: the
    store's ``decision_merge_window_s``)."""
    body = _json_document(numbers, "numbers")
    kind = _label(kind, "kind", max_length=32)
    if key is not None:
        key = _label(key, "key", max_length=_DECISION_KEY_MAX)
        same = _repeated(session, app_id, kind, key, at, merge_window_s)
        if same is not None:
            same.count += 1
            seen = same.at if same.last_at is None else same.last_at
            same.last_at = max(seen, at)
            same.reason = reason
            same.numbers = body
            session.flush()
            return same
    return _add_row(session, app_id, kind, reason, body, key, at)


def add_keyed(
    session: Session, app_id: int, said: Keyed | None, at: datetime, merge_window_s: float
) -> None:
    """:func:`add_decision` of the keyed decision ``said`` (nothing for None): merged with its
    key's repeats as :meth:`DecisionStore.record_decision` merges them."""
    if said is not None:
        kind, reason, numbers, key = said
        add_decision(
            session, app_id, kind, reason, numbers, at, key=key, merge_window_s=merge_window_s
        )


def _repeated(
    session: Session, app_id: int, kind: str, key: str, now: datetime, merge_window_s: float
) -> m.DecisionRow | None:
    """The row a keyed decision repeats (see :meth:`DecisionStore.record_decision`), or None."""
    newest = (m.DecisionRow.at.desc(), m.DecisionRow.id.desc())
    same = session.scalars(
        select(m.DecisionRow)
        .where(m.DecisionRow.app_id == app_id, m.DecisionRow.kind == kind, m.DecisionRow.key == key)
        .order_by(*newest)
        .limit(1)
    ).first()
    if same is None:
        return None
    seen = same.at if same.last_at is None else same.last_at
    if (now - seen).total_seconds() <= merge_window_s:
        return same
    latest = session.scalars(
        select(m.DecisionRow.id)
        .where(m.DecisionRow.app_id == app_id, m.DecisionRow.kind == kind)
        .order_by(*newest)
        .limit(1)
    ).first()
    return same if latest == same.id else None


def _add_row(
    session: Session,
    app_id: int,
    kind: str,
    reason: str,
    body: dict[str, Any],
    key: str | None,
    at: datetime,
) -> m.DecisionRow:
    decision = m.DecisionRow(
        app_id=app_id, at=at, kind=kind, reason=reason, numbers=body, key=key, count=1
    )
    session.add(decision)
    session.flush()
    return decision


class DecisionStore(StoreBase):
    """The decision log (see the module docstring)."""

    # --- decisions and metrics -----------------------------------------------------------------

    @_translated
    def record_decision(
        self,
        app: str,
        kind: str,
        reason: str,
        numbers: Mapping[str, Any] | None = None,
        *,
        at: datetime | None = None,
        key: str | None = None,
    ) -> DecisionRecord:
        """Record what a policy decided (``kind``: scale_up, scale_down, gear_switch, replan,
        budget_drain, ...), why, and the numbers behind it (a JSON object).

        ``key`` is the caller's identity of "the same decision" (``f"{request_id}:{error}"`` for
        a failed launch, ``f"{stage}:{reason}"`` for a budget cap). A keyed decision repeats the
        app's newest one of the same kind and key when that one is still the app's latest
        decision of the kind, or was last made within ``decision_merge_window_s``: its row then
        counts one more (``count``), takes ``at`` as its ``last_at`` and the newest reason and
        numbers, and keeps its first ``at``. Anything else adds a row (count 1)."""
        (decision,) = self.record_decisions(app, [(kind, reason, numbers or {}, key)], at=at)
        return decision

    @_translated
    def record_decisions(
        self,
        app: str,
        decisions: Sequence[tuple[str, str, Mapping[str, Any], str | None]],
        *,
        at: datetime | None = None,
    ) -> list[DecisionRecord]:
        """Record ``decisions`` of ``app``, each ``(kind, reason, numbers, key)`` as
        :meth:`record_decision` does, in one transaction: what one pass of a loop decided
        (the tuner's stages), all or none (a crash between two would leave the first saying
        what the second did, :data:`~controlplane.loops.reached.FLEETS_AFTER`, and the second
        never said)."""
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            return [
                _decision_record(
                    add_decision(
                        session,
                        row.id,
                        kind,
                        reason,
                        numbers,
                        now,
                        key=key,
                        merge_window_s=self.decision_merge_window_s,
                    ),
                    app,
                )
                for kind, reason, numbers, key in decisions
            ]

    @_translated
    def list_decisions(
        self,
        app: str | None = None,
        *,
        since: datetime | None = None,
        kinds: Iterable[str] | None = None,
        exclude_kinds: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[DecisionRecord]:
        """The decisions (of ``app``), oldest first: made after ``since`` (a decision made
        again counts by its ``last_at``, as retention does: a failed launch repeated every 5 s
        for an hour is in its last 10 minutes), of ``kinds`` only and of none of ``exclude_kinds``,
        filtered in the query, so ``limit`` (the newest that many, a decision made again
        counting by its ``last_at`` too) counts only the decisions that pass."""
        with transaction(self._sessions) as session:
            query = select(m.DecisionRow, m.App.name).join(m.App, m.App.id == m.DecisionRow.app_id)
            if app is not None:
                query = query.where(m.DecisionRow.app_id == _app_row(session, app).id)
            if since is not None:
                after = self._now(since)
                query = query.where(or_(m.DecisionRow.at > after, m.DecisionRow.last_at > after))
            if kinds is not None:
                query = query.where(m.DecisionRow.kind.in_(list(kinds)))
            if exclude_kinds is not None:
                query = query.where(m.DecisionRow.kind.not_in(list(exclude_kinds)))
            # The newest by last time (a decision made again is as new as its last time, as
            # ``since`` judges it), listed oldest first by first time.
            if limit is None:
                rows = _newest_rows(session, query, m.DecisionRow.at, m.DecisionRow.id, None)
            else:
                seen = func.coalesce(m.DecisionRow.last_at, m.DecisionRow.at)
                rows = _newest_rows(session, query, seen, m.DecisionRow.id, limit)
                rows.sort(key=lambda row: (row[0].at, row[0].id))
            return [_decision_record(decision, name) for decision, name in rows]

    @_translated
    def delete_decisions(self, *, before: datetime | None = None, keep: int | None = None) -> int:
        """Retention of the decision log: delete every decision last made before ``before``
        (``last_at``, else ``at``), and all but the newest ``keep`` (by first time) of each app;
        return how many went."""
        removed = 0
        with transaction(self._sessions) as session:
            if before is not None:
                seen = func.coalesce(m.DecisionRow.last_at, m.DecisionRow.at)
                result = session.execute(delete(m.DecisionRow).where(seen < self._now(before)))
                removed += int(cast(CursorResult[Any], result).rowcount)
            if keep is not None:
                if keep < 0:
                    raise InvalidValueError("keep", f"must be >= 0, got {keep}")
                crowded = session.scalars(
                    select(m.DecisionRow.app_id)
                    .group_by(m.DecisionRow.app_id)
                    .having(func.count(m.DecisionRow.id) > keep)
                ).all()
                for app_id in crowded:
                    older = (
                        select(m.DecisionRow.id)
                        .where(m.DecisionRow.app_id == app_id)
                        .order_by(m.DecisionRow.at.desc(), m.DecisionRow.id.desc())
                        .offset(keep)
                    )
                    ids = list(session.scalars(older))
                    for start in range(0, len(ids), 500):
                        result = session.execute(
                            delete(m.DecisionRow).where(
                                m.DecisionRow.id.in_(ids[start : start + 500])
                            )
                        )
                        removed += int(cast(CursorResult[Any], result).rowcount)
        return removed
