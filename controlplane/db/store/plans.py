"""Plans: stored per app, applied while the app is still at the version they were made for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    _ATTEMPTS,
    StoreBase,
    _app_row,
    _check_version,
    _compare_and_set,
    _json_document,
    _LostRaceError,
    _newest,
    _plan_row,
    _still_racing,
    _translated,
)
from controlplane.db.store.decisions import Words, add_decision
from controlplane.db.store.records import (
    PlanRecord,
    _plan_record,
)
from controlplane.errors import ConflictError

__all__ = ["PlanStore"]


class PlanStore(StoreBase):
    """Plans (see the module docstring)."""

    # --- plans ---------------------------------------------------------------------------------

    @_translated
    def create_plan(
        self, app: str, document: Mapping[str, Any], *, at: datetime | None = None
    ) -> PlanRecord:
        """Record a previewed plan (``Plan.to_document()`` and whatever else the caller adds)
        for the app at its current version; it gets the app's next plan number."""
        body = _json_document(document, "document")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app)
                    last = session.scalar(
                        select(func.max(m.Plan.number)).where(m.Plan.app_id == row.id)
                    )
                    plan = m.Plan(
                        app_id=row.id,
                        number=(last or 0) + 1,
                        status="previewed",
                        document=body,
                        app_version=row.version,
                        created_at=now,
                        applied_at=None,
                    )
                    session.add(plan)
                    session.flush()
                    return _plan_record(plan, app)
            except IntegrityError:
                continue  # another plan took the number: take the next
        raise _still_racing(app)

    @_translated
    def get_plan(self, app: str, plan_id: int) -> PlanRecord:
        with transaction(self._sessions) as session:
            return _plan_record(_plan_row(session, _app_row(session, app), plan_id), app)

    @_translated
    def get_applied_plan(self, app: str) -> PlanRecord | None:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            if row.applied_plan_id is None:
                return None
            return _plan_record(_plan_row(session, row, row.applied_plan_id), app)

    @_translated
    def list_plans(self, app: str, *, limit: int | None = None) -> list[PlanRecord]:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            query = select(m.Plan).where(m.Plan.app_id == row.id)
            plans = _newest(session, query, m.Plan.number, m.Plan.id, limit)
            return [_plan_record(plan, app) for plan in plans]

    @_translated
    def apply_plan(
        self,
        app: str,
        plan_id: int,
        *,
        expected_version: int | None = None,
        said: Callable[[PlanRecord], Words] | None = None,
        at: datetime | None = None,
    ) -> PlanRecord:
        """Make the previewed plan the app's applied plan (the one it had becomes superseded).
        ``said``: the decisions that say the apply (of the plan as applied), written in the same
        transaction: a crash between the two would leave the plan applied and never said (an
        apply again is refused, the plan applied already; a re-planning loop started again reads
        it done).

        :class:`ConflictError` when the plan is not previewed any more, or the app changed since
        the plan was made (its spec, budget or applied plan; then the plan is stale: preview
        another), or the app is not at ``expected_version`` (when given). Of concurrent applies
        for one app, exactly one succeeds.
        """
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            plan = _plan_row(session, row, plan_id)
            if plan.status != "previewed":
                raise ConflictError(f"plan {plan.id} of app {app!r} is already {plan.status}")
            _check_version(row, expected_version)
            if plan.app_version != row.version:
                raise ConflictError(
                    f"plan {plan.id} was made for version {plan.app_version} of app {app!r},"
                    f" which is now at version {row.version}; preview a new plan"
                )
            superseded = row.applied_plan_id
            try:
                _compare_and_set(session, row, applied_plan_id=plan.id, updated_at=now)
            except _LostRaceError:
                raise ConflictError(
                    f"app {app!r} changed while plan {plan.id} was being applied"
                ) from None
            if superseded is not None:
                session.execute(
                    update(m.Plan)
                    .where(m.Plan.id == superseded, m.Plan.status == "applied")
                    .values(status="superseded")
                    .execution_options(synchronize_session=False)
                )
            session.execute(
                update(m.Plan)
                .where(m.Plan.id == plan.id)
                .values(status="applied", applied_at=now)
                .execution_options(synchronize_session=False)
            )
            session.refresh(plan)
            applied = _plan_record(plan, app)
            for kind, text, numbers in said(applied) if said is not None else ():
                add_decision(session, row.id, kind, text, numbers, now)
            return applied
