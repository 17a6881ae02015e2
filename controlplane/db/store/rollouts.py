"""The store's rollouts (docs/rollouts.md): a new model version moving into an app step by step.

- :meth:`RolloutStore.create_rollout` records a rollout in ``pending``; an app with a rollout
  still active (pending, running or paused) refuses a second one
  (:class:`~controlplane.errors.ConflictError`, decided under the app row's lock, so of two
  concurrent starts one wins).
- :meth:`RolloutStore.move_rollout` changes a rollout's state, step, figures, reason and
  settings,
  compare-and-set on the state and step it was read at (a loop and a user acting at once: one
  wins, the other reads :class:`~controlplane.errors.ConflictError`), along the table of
  :data:`controlplane.policies.rollout.TRANSITIONS`; the decisions that say the move are written
  in its transaction (``said``), so that a crash leaves the move and its words both or neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import StoreBase, _app_row, _json_document, _label, _translated
from controlplane.db.store.decisions import add_decision
from controlplane.errors import ConflictError, NotFoundError
from controlplane.policies.rollout_states import (
    ACTIVE_STATES,
    RolloutState,
    check_rollout_transition,
)

__all__ = ["RolloutRecord", "RolloutStore", "Said"]


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    id: int
    app: str
    model: str
    artifact: str
    from_version: int
    to_version: int
    state: str
    step_index: int
    settings: Mapping[str, Any]
    figures: Mapping[str, Any]
    reason: str
    who: str
    step_started_at: datetime
    created_at: datetime
    updated_at: datetime

    @property
    def steps(self) -> tuple[float, ...]:
        """The shares of the steps; a shadow rollout's first is 0 (its shadow step)."""
        return tuple(float(s) for s in self.settings["steps"])

    @property
    def step_share(self) -> float:
        return self.steps[min(self.step_index, len(self.steps) - 1)]

    @property
    def shadow_step(self) -> bool:
        """Whether the current step mirrors every query to the new version (share 0)."""
        return bool(self.settings.get("shadow")) and self.step_index == 0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


# What says a move (:meth:`RolloutStore.move_rollout`): of the rollout as moved, the decisions
# written with it, each ``(kind, reason, numbers)``.
Said = Callable[["RolloutRecord"], Sequence[tuple[str, str, Mapping[str, Any]]]]


class RolloutStore(StoreBase):
    """The store's part for the ``rollouts`` table."""

    @_translated
    def create_rollout(
        self,
        app: str,
        *,
        model: str,
        artifact: str,
        from_version: int,
        to_version: int,
        settings: Mapping[str, Any],
        reason: str,
        who: str,
        app_spec: Mapping[str, Any] | None = None,
        said: Said | None = None,
        at: datetime | None = None,
    ) -> RolloutRecord:
        """Record a rollout in ``pending``. :class:`ConflictError` while another of the app's
        is active, or, with ``app_spec`` (the spec its start checked), when the app's spec is
        another now (a replace committed between the start's checks and this; a plan applied
        meanwhile, which moves the app's version, is no conflict). ``said``: the decisions that
        say the start (of the rollout as recorded), written in the same transaction, as
        :meth:`move_rollout`'s."""
        now = self._now(at)
        body = _json_document(settings, "settings")
        with transaction(self._sessions) as session:
            app_row = _app_row(session, app, lock=True)
            if app_spec is not None and app_row.spec != dict(app_spec):
                raise ConflictError(
                    f"app {app!r}: its spec was replaced while the rollout was being started;"
                    " start it again"
                )
            busy = session.scalar(
                select(m.Rollout.id).where(
                    m.Rollout.app_id == app_row.id,
                    m.Rollout.state.in_([s.value for s in ACTIVE_STATES]),
                )
            )
            if busy is not None:
                raise ConflictError(
                    f"app {app!r} has rollout {busy} in progress; one rollout per app at a"
                    f" time (heteroplane rollout status --app {app})"
                )
            row = m.Rollout(
                app_id=app_row.id,
                model=model,
                artifact=artifact,
                from_version=from_version,
                to_version=to_version,
                state=RolloutState.PENDING.value,
                step_index=0,
                settings=body,
                figures={},
                reason=reason,
                who=_label(who, "who"),
                step_started_at=now,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            session.flush()
            started = _record(row, app)
            for kind, text, numbers in said(started) if said is not None else ():
                add_decision(session, app_row.id, kind, text, numbers, now)
            return started

    @_translated
    def get_rollout(self, app: str, rollout_id: int) -> RolloutRecord:
        with transaction(self._sessions) as session:
            app_row = _app_row(session, app)
            row = session.get(m.Rollout, rollout_id)
            if row is None or row.app_id != app_row.id:
                raise NotFoundError("rollout", rollout_id)
            return _record(row, app)

    @_translated
    def list_rollouts(self, app: str | None = None, *, active: bool = False) -> list[RolloutRecord]:
        """Rollouts oldest first (of ``app``; only active ones with ``active``)."""
        with transaction(self._sessions) as session:
            query = select(m.Rollout, m.App.name).join(m.App, m.App.id == m.Rollout.app_id)
            if app is not None:
                query = query.where(m.Rollout.app_id == _app_row(session, app).id)
            if active:
                query = query.where(m.Rollout.state.in_([s.value for s in ACTIVE_STATES]))
            rows = session.execute(query.order_by(m.Rollout.id)).all()
            return [_record(row, name) for row, name in rows]

    def current_rollout(self, app: str) -> RolloutRecord | None:
        """The app's active rollout, else its latest, else None."""
        found = self.list_rollouts(app)
        active = [r for r in found if r.active]
        if active:
            return active[-1]
        return found[-1] if found else None

    @_translated
    def move_rollout(
        self,
        seen: RolloutRecord,
        *,
        state: str | None = None,
        step_index: int | None = None,
        figures: Mapping[str, Any] | None = None,
        reason: str | None = None,
        new_step: bool = False,
        settings: Mapping[str, Any] | None = None,
        said: Said | None = None,
        at: datetime | None = None,
    ) -> RolloutRecord:
        """``seen`` moved to ``state`` / ``step_index`` (``new_step``: the step's clock starts
        again now), with its figures and reason (and ``settings``: the whole settings document,
        as the loop completes them: what the start's profile run measured, the step's extra
        fleet); :class:`ConflictError` when the row is no longer at the state and step ``seen``
        read. ``said``: the decisions that say the move (of the rollout as moved), written in the
        same transaction: a crash between the two would leave a move said never (the restarted
        loop reads it done) or, written first, twice."""
        if state is not None and state != seen.state:
            check_rollout_transition(seen.state, state)
        now = self._now(at)
        values: dict[str, Any] = {"updated_at": now}
        if state is not None:
            values["state"] = state
        if step_index is not None:
            values["step_index"] = step_index
        if figures is not None:
            values["figures"] = _json_document(figures, "figures")
        if reason is not None:
            values["reason"] = reason
        if settings is not None:
            values["settings"] = _json_document(settings, "settings")
        if new_step:
            values["step_started_at"] = now
        with transaction(self._sessions) as session:
            done = session.execute(
                update(m.Rollout)
                .where(
                    m.Rollout.id == seen.id,
                    m.Rollout.state == seen.state,
                    m.Rollout.step_index == seen.step_index,
                )
                .values(**values)
            )
            if getattr(done, "rowcount", 0) != 1:
                raise ConflictError(
                    f"rollout {seen.id} of {seen.app!r} changed meanwhile; read it again"
                )
            row = session.get(m.Rollout, seen.id)
            assert row is not None
            session.refresh(row)
            moved = _record(row, seen.app)
            for kind, text, numbers in said(moved) if said is not None else ():
                add_decision(session, row.app_id, kind, text, numbers, now)
            return moved


def _record(row: m.Rollout, app: str) -> RolloutRecord:
    return RolloutRecord(
        id=row.id,
        app=app,
        model=row.model,
        artifact=row.artifact,
        from_version=row.from_version,
        to_version=row.to_version,
        state=row.state,
        step_index=row.step_index,
        settings=dict(row.settings),
        figures=dict(row.figures),
        reason=row.reason,
        who=row.who,
        step_started_at=row.step_started_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )
