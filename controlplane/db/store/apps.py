"""Apps and their budgets: registration, spec and budget changes (compare-and-set on the
app's version), the budget's audit trail, deletion."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    _ATTEMPTS,
    StoreBase,
    _app_name,
    _app_row,
    _budget,
    _check_version,
    _compare_and_set,
    _json_document,
    _label,
    _LostRaceError,
    _newest,
    _still_racing,
    _translated,
    _values,
)
from controlplane.db.store.decisions import Words, add_decision
from controlplane.db.store.records import (
    AppRecord,
    BudgetChangeRecord,
    _app_record,
    _budget_record,
)
from controlplane.errors import (
    AppExistsError,
    ConflictError,
    InvalidValueError,
)
from controlplane.policies.lifecycle import LIVE_STATES
from controlplane.policies.rollout_states import ACTIVE_STATES, spec_held_by_rollout

__all__ = ["AppStore"]


def _drop_profiles(session: Session, app_id: int, models: set[str], now: datetime) -> None:
    """Drop the app's measured profiles (and artifacts) of ``models``; a document left with no
    profile is deleted (one of none is refused when read: none is what "not measured" is)."""
    found = session.get(m.AppProfiles, app_id)
    if found is None:
        return
    document = dict(found.document)
    kept = [p for p in document.get("profiles") or () if p.get("model") not in models]
    if not kept:
        session.delete(found)
        return
    artifacts = {n: ref for n, ref in (document.get("artifacts") or {}).items() if n not in models}
    found.document = {**document, "profiles": kept, "artifacts": artifacts}
    found.measured_at = now


class AppStore(StoreBase):
    """Apps and their budgets (see the module docstring)."""

    # --- apps ----------------------------------------------------------------------------------

    @_translated
    def create_app(
        self,
        spec_document: Mapping[str, Any],
        budget_usd_per_hr: float | None = None,
        *,
        who: str,
        at: datetime | None = None,
    ) -> AppRecord:
        """Register the app ``spec_document`` describes (its ``name`` key names it), with its
        budget (default: the document's ``budget_usd_per_hr``); the budget's first audit row says
        who registered it. :class:`AppExistsError` when the name is taken."""
        name = _app_name(spec_document)
        budget = _budget(
            budget_usd_per_hr
            if budget_usd_per_hr is not None
            else spec_document.get("budget_usd_per_hr")
        )
        spec = _json_document({**spec_document, "budget_usd_per_hr": budget}, "spec")
        now = self._now(at)
        try:
            with transaction(self._sessions) as session:
                row = m.App(
                    name=name,
                    spec=spec,
                    budget_usd_per_hr=budget,
                    version=1,
                    created_at=now,
                    updated_at=now,
                )
                session.add(row)
                session.flush()
                session.add(
                    m.BudgetChange(
                        app_id=row.id,
                        who=_label(who, "who"),
                        at=now,
                        old_usd_per_hr=None,
                        new_usd_per_hr=budget,
                        reason="app registered",
                    )
                )
                return _app_record(row)
        except IntegrityError:
            raise AppExistsError(name) from None

    @_translated
    def get_app(self, name: str) -> AppRecord:
        with transaction(self._sessions) as session:
            return _app_record(_app_row(session, name))

    @_translated
    def list_apps(self) -> list[AppRecord]:
        with transaction(self._sessions) as session:
            rows = session.scalars(select(m.App).order_by(m.App.name))
            return [_app_record(row) for row in rows]

    @_translated
    def update_app(
        self,
        name: str,
        spec_document: Mapping[str, Any],
        *,
        who: str,
        expected_version: int | None = None,
        unless_rollout: str | None = None,
        drop_profiles: Collection[str] = (),
        said: Words = (),
        at: datetime | None = None,
    ) -> AppRecord:
        """Replace the app's spec (its name cannot change); a new budget in it is audited like
        :meth:`change_budget`. :class:`ConflictError` if the app is no longer at
        ``expected_version`` (when given), or, with ``unless_rollout`` (what the replace changes
        that a rollout works on), while a rollout of the app is active: checked under the app's
        lock, which a rollout's start takes too, so neither slips past the other. In the same
        transaction (a crash leaves all or none): the app's measured profiles of the models
        ``drop_profiles`` dropped (the spec moves them to other bytes), and the decisions
        ``said``."""
        if _app_name(spec_document) != name:
            raise InvalidValueError(
                "name", f"an app cannot be renamed ({name!r} -> {spec_document.get('name')!r})"
            )
        budget = _budget(spec_document.get("budget_usd_per_hr"))
        spec = _json_document(spec_document, "spec")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, name, lock=unless_rollout is not None)
                    _check_version(row, expected_version)
                    if unless_rollout is not None:
                        _refuse_during_rollout(session, row, unless_rollout)
                    old_budget = row.budget_usd_per_hr
                    _compare_and_set(
                        session,
                        row,
                        spec=spec,
                        budget_usd_per_hr=budget,
                        updated_at=now,
                    )
                    if budget != old_budget:
                        session.add(
                            m.BudgetChange(
                                app_id=row.id,
                                who=_label(who, "who"),
                                at=now,
                                old_usd_per_hr=old_budget,
                                new_usd_per_hr=budget,
                                reason="spec updated",
                            )
                        )
                    if drop_profiles:
                        _drop_profiles(session, row.id, set(drop_profiles), now)
                    for kind, text, numbers in said:
                        add_decision(session, row.id, kind, text, numbers, now)
                    return _app_record(_app_row(session, name))
            except _LostRaceError:
                continue
        raise _still_racing(name)

    @_translated
    def delete_app(self, name: str, *, force: bool = False) -> None:
        """Delete the app and everything recorded about it (plans, instances, events, decisions,
        metrics, budget history). Refused with :class:`ConflictError` while it has live
        instances, unless ``force`` (their rows go too; the provider's instances do not)."""
        with transaction(self._sessions) as session:
            row = _app_row(session, name)
            live = session.scalar(
                select(func.count())
                .select_from(m.Instance)
                .where(m.Instance.app_id == row.id, m.Instance.state.in_(_values(LIVE_STATES)))
            )
            if live and not force:
                raise ConflictError(
                    f"app {name!r} still has {live} live instance(s); drain them first (take"
                    f" the app down: heteroplane app down {name}, or delete with drain=true), or"
                    " delete it with force (its machines run on)"
                )
            session.execute(delete(m.App).where(m.App.id == row.id))

    # --- budgets -------------------------------------------------------------------------------

    @_translated
    def change_budget(
        self,
        app: str,
        new_usd_per_hr: float,
        *,
        reason: str,
        who: str,
        expected_version: int | None = None,
        said: Words = (),
        at: datetime | None = None,
    ) -> BudgetChangeRecord:
        """Set the app's budget (and its spec's ``budget_usd_per_hr``) and audit it. Concurrent
        changes serialise (the app's row is locked for the change; a lost race, possible only
        without the lock, is retried), so the audit trail is a chain. With
        ``expected_version``, :class:`ConflictError` if the app changed since. ``said``: the
        decisions that say it (its ``budget_drain``), written in the same transaction: a crash
        between the two left the budget lowered and the drain never said."""
        budget = _budget(new_usd_per_hr)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app, lock=True)
                    # Read under the lock (and again on a retry): the chain's times go up.
                    now = self._now(at)
                    _check_version(row, expected_version)
                    old = row.budget_usd_per_hr
                    _compare_and_set(
                        session,
                        row,
                        spec={**row.spec, "budget_usd_per_hr": budget},
                        budget_usd_per_hr=budget,
                        updated_at=now,
                    )
                    change = m.BudgetChange(
                        app_id=row.id,
                        who=_label(who, "who"),
                        at=now,
                        old_usd_per_hr=old,
                        new_usd_per_hr=budget,
                        reason=reason,
                    )
                    session.add(change)
                    session.flush()
                    for kind, text, numbers in said:
                        add_decision(session, row.id, kind, text, numbers, now)
                    return _budget_record(change, app)
            except _LostRaceError:
                continue
        raise _still_racing(app)

    @_translated
    def list_budget_changes(
        self, app: str, *, limit: int | None = None
    ) -> list[BudgetChangeRecord]:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            query = select(m.BudgetChange).where(m.BudgetChange.app_id == row.id)
            # In chain order, not by time: each change is written under the app's row lock, so
            # ids follow the chain (``at`` is read under it too, but from the clock of whichever
            # replica made the change).
            changes = _newest(session, query, m.BudgetChange.id, m.BudgetChange.id, limit)
            return [_budget_record(change, app) for change in changes]


def _refuse_during_rollout(session: Session, row: m.App, changes: str) -> None:
    """A :class:`ConflictError` when a rollout of the app is active (pending, running, paused):
    it works on the spec's ``changes`` as they were."""
    found = session.execute(
        select(m.Rollout.id, m.Rollout.model, m.Rollout.state).where(
            m.Rollout.app_id == row.id,
            m.Rollout.state.in_([state.value for state in ACTIVE_STATES]),
        )
    ).first()
    if found is not None:
        rollout_id, model, state = found
        raise ConflictError(spec_held_by_rollout(row.name, rollout_id, model, state, changes))
