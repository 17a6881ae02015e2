"""Instances: recorded once per launch request, moved through the lifecycle's states
(compare-and-set on the state seen), their events."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    _ATTEMPTS,
    StoreBase,
    _app_row,
    _instance_row,
    _instances_query,
    _label,
    _LostRaceError,
    _newest_rows,
    _number,
    _state,
    _still_racing,
    _translated,
    _values,
)
from controlplane.db.store.decisions import Keyed, Words, add_decision, add_keyed
from controlplane.db.store.records import (
    InstanceEventRecord,
    InstanceRecord,
    _event_record,
    _instance_record,
)
from controlplane.errors import ConflictError, ControlPlaneError, InvalidValueError
from controlplane.policies.lifecycle import LIVE_STATES, InstanceState, check_transition
from provisioners.interruptions import MARKETS

__all__ = ["InstanceStore"]

# Ids per ``IN (...)`` of a query (SQLite's bound parameters are limited).
_IN_CHUNK = 500


def _starting(prefix: str) -> str:
    """A LIKE pattern (escaped with a backslash) for the strings that start with ``prefix``.

    >>> _starting("a_b%")
    'a\\\\_b\\\\%%'
    """
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _try_move(
    session: Session,
    instance_id: str,
    to_state: str,
    reason: str,
    now: datetime,
    values: Mapping[str, Any] | None = None,
) -> tuple[m.Instance, str] | None:
    """One try at moving the row ``instance_id`` to ``to_state`` (with ``values`` set too) and
    recording the move's ``instance_events`` row, in ``session``'s transaction: the row and its
    app's name, or None when another writer moved the row between its read and its write (the
    compare-and-set on its state). :class:`InvalidTransitionError` when the lifecycle table
    does not allow the move."""
    instance, name = _instance_row(session, instance_id)
    from_state = instance.state
    check_transition(from_state, to_state)
    result = session.execute(
        update(m.Instance)
        .where(m.Instance.id == instance_id, m.Instance.state == from_state)
        .values(state=to_state, updated_at=now, **(values or {}))
        .execution_options(synchronize_session=False)
    )
    if cast(CursorResult[Any], result).rowcount != 1:
        session.expire(instance)  # read again: what the other writer committed
        return None
    session.add(
        m.InstanceEvent(
            instance_id=instance_id,
            from_state=from_state,
            to_state=to_state,
            at=now,
            reason=reason,
        )
    )
    session.flush()
    session.refresh(instance)
    return instance, name


def _move_row(
    session: Session, instance_id: str, to_state: str, reason: str, now: datetime
) -> InstanceRecord:
    """:meth:`InstanceStore.transition_instances`' move of one row in ``session``'s transaction.
    A row another writer moved between its read and its write (PostgreSQL lets one in: a
    drain by ``app down``) is read again and moved from where it is now, as
    :meth:`InstanceStore.transition_instance` retries it (left where the other writer put it,
    a terminate's row stayed draining with its machine ended)."""
    for _ in range(_ATTEMPTS):
        moved = _try_move(session, instance_id, to_state, reason, now)
        if moved is not None:
            return _instance_record(*moved)
    raise ConflictError(f"instance {instance_id!r} kept changing state; try again")


class InstanceStore(StoreBase):
    """Instances and their events (see the module docstring)."""

    # --- instances -----------------------------------------------------------------------------

    @_translated
    def record_instance(
        self,
        app: str,
        *,
        request_id: str,
        instance_type: str,
        price_usd_per_hr: float,
        provider_id: str | None = None,
        state: str = InstanceState.REQUESTED,
        reason: str = "launch requested",
        at: datetime | None = None,
        market: str = "on-demand",
        said: Callable[[InstanceRecord], Words] | None = None,
    ) -> InstanceRecord:
        """Record an instance we launch (or adopt) under the idempotency key ``request_id``: the
        same request id again returns the instance recorded the first time, never a second one
        (:class:`ConflictError` if that was for another app or type). ``market``: ``on-demand``
        or ``spot``. ``said``: the decisions that say the row (of the row as recorded), written
        in its transaction (a stand-in's, which a reconciler started again reads back: a crash
        between the two left the row counted as its own type); none for a row found."""
        if market not in MARKETS:
            raise InvalidValueError("market", f"must be on-demand or spot, got {market!r}")
        request_id = _label(request_id, "request_id")
        state = _state(state)
        price = _number(price_usd_per_hr, "price_usd_per_hr")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            existing = self._instance_by_request(request_id)
            if existing is not None:
                if existing.app != app or existing.instance_type != instance_type:
                    raise ConflictError(
                        f"request id {request_id!r} already launched a {existing.instance_type}"
                        f" for app {existing.app!r}"
                    )
                return existing
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app)
                    instance = m.Instance(
                        id=str(uuid.uuid4()),
                        app_id=row.id,
                        request_id=request_id,
                        provider_id=provider_id,
                        instance_type=_label(instance_type, "instance_type"),
                        state=state,
                        price_usd_per_hr=price,
                        created_at=now,
                        updated_at=now,
                        market=market,
                    )
                    session.add(instance)
                    session.flush()
                    session.add(
                        m.InstanceEvent(
                            instance_id=instance.id,
                            from_state=None,
                            to_state=state,
                            at=now,
                            reason=reason,
                        )
                    )
                    recorded = _instance_record(instance, app)
                    for kind, text, numbers in said(recorded) if said is not None else ():
                        add_decision(session, row.id, kind, text, numbers, now)
                    return recorded
            except IntegrityError:
                if self._instance_by_request(request_id) is None:
                    raise ConflictError(
                        f"provider id {provider_id!r} is already recorded for another instance"
                    ) from None
                # A concurrent launch with the same request id won: return its row.
        raise _still_racing(app)

    def _instance_by_request(self, request_id: str) -> InstanceRecord | None:
        with transaction(self._sessions) as session:
            found = session.execute(
                _instances_query().where(m.Instance.request_id == request_id)
            ).first()
            return None if found is None else _instance_record(found[0], found[1])

    @_translated
    def get_instance(self, instance_id: str) -> InstanceRecord:
        with transaction(self._sessions) as session:
            return _instance_record(*_instance_row(session, instance_id))

    @_translated
    def find_instance(self, *, provider_id: str) -> InstanceRecord | None:
        """The instance the provider knows as ``provider_id``, if we recorded one."""
        with transaction(self._sessions) as session:
            found = session.execute(
                _instances_query().where(m.Instance.provider_id == provider_id)
            ).first()
            return None if found is None else _instance_record(found[0], found[1])

    @_translated
    def list_instances(
        self,
        app: str | None = None,
        states: Iterable[str] | None = None,
        *,
        limit: int | None = None,
        ended_after: datetime | None = None,
        request_prefix: str | None = None,
    ) -> list[InstanceRecord]:
        """Instances (of ``app``, in one of ``states``), oldest first; with ``limit``, the
        newest ``limit`` of them (still oldest first); with ``ended_after``, the ended ones
        (terminated, failed) only where their last move came after it (the rows of a fleet
        that has cycled for weeks are mostly ended: a loop that reads every tick asks for the
        live ones and the recent past); with ``request_prefix``, those whose request id starts
        with it (a rollout's workers)."""
        with transaction(self._sessions) as session:
            query = _instances_query()
            if app is not None:
                query = query.where(m.Instance.app_id == _app_row(session, app).id)
            if request_prefix is not None:
                query = query.where(
                    m.Instance.request_id.like(_starting(request_prefix), escape="\\")
                )
            if states is not None:
                query = query.where(m.Instance.state.in_([_state(s) for s in states]))
            if ended_after is not None:
                query = query.where(
                    or_(
                        m.Instance.state.in_(_values(LIVE_STATES)),
                        m.Instance.updated_at > self._now(ended_after),
                    )
                )
            rows = _newest_rows(session, query, m.Instance.created_at, m.Instance.id, limit)
            return [_instance_record(instance, name) for instance, name in rows]

    @_translated
    def count_instances(self) -> dict[tuple[str, str], int]:
        """How many instances each app has in each state, ended ones too: (app, state) -> n,
        counted by the database (the /metrics gauge; reading every row to count them grew
        with the fleet's whole history)."""
        with transaction(self._sessions) as session:
            query = (
                select(m.App.name, m.Instance.state, func.count())
                .join(m.App, m.App.id == m.Instance.app_id)
                .group_by(m.App.name, m.Instance.state)
            )
            return {(app, state): int(n) for app, state, n in session.execute(query).tuples()}

    @_translated
    def list_ended_instances(
        self, app: str, *, provider_ids: Collection[str] = (), request_ids: Collection[str] = ()
    ) -> list[InstanceRecord]:
        """The app's ended instances (terminated, failed) with one of ``provider_ids`` or
        ``request_ids``, oldest first: those a provider still lists, however long ago they
        ended."""
        found: dict[str, InstanceRecord] = {}
        with transaction(self._sessions) as session:
            app_id = _app_row(session, app).id
            for column, ids in (
                (m.Instance.provider_id, sorted(provider_ids)),
                (m.Instance.request_id, sorted(request_ids)),
            ):
                for start in range(0, len(ids), _IN_CHUNK):
                    query = _instances_query().where(
                        m.Instance.app_id == app_id,
                        m.Instance.state.not_in(_values(LIVE_STATES)),
                        column.in_(ids[start : start + _IN_CHUNK]),
                    )
                    for instance, name in session.execute(query).tuples():
                        found[instance.id] = _instance_record(instance, name)
        return sorted(found.values(), key=lambda r: (r.created_at, r.id))

    @_translated
    def list_request_ids(self, app: str, prefix: str) -> list[str]:
        """The request ids of every instance of the app (ended ones too) that start with
        ``prefix``: one column, for numbering a launch past every id used."""
        with transaction(self._sessions) as session:
            query = select(m.Instance.request_id).where(
                m.Instance.app_id == _app_row(session, app).id,
                m.Instance.request_id.like(_starting(prefix), escape="\\"),
            )
            return list(session.execute(query).scalars())

    @_translated
    def delete_ended_instances(
        self, *, before: datetime, keep: Collection[str] = (), limit: int | None = None
    ) -> int:
        """Retention of the instance history: delete the ended instances (terminated, failed)
        whose last move came before ``before``, with their events, but those whose request id is
        in ``keep`` (each app's newest launch, which numbers the next); with ``limit``, the
        oldest ``limit`` of them at most. Return how many went."""
        if limit is not None and limit < 1:
            raise InvalidValueError("limit", f"must be >= 1, got {limit}")
        removed = 0
        with transaction(self._sessions) as session:
            query = (
                select(m.Instance.id)
                .where(
                    m.Instance.state.not_in(_values(LIVE_STATES)),
                    m.Instance.updated_at < self._now(before),
                    m.Instance.request_id.not_in(sorted(keep)),
                )
                .order_by(m.Instance.updated_at, m.Instance.id)
                .limit(limit)
            )
            ids = list(session.execute(query).scalars())
            for start in range(0, len(ids), _IN_CHUNK):
                # Their events go with them (instance_events' foreign key cascades).
                chunk = ids[start : start + _IN_CHUNK]
                result = session.execute(delete(m.Instance).where(m.Instance.id.in_(chunk)))
                removed += int(cast(CursorResult[Any], result).rowcount)
        return removed

    @_translated
    def transition_instance(
        self,
        instance_id: str,
        to_state: str,
        *,
        reason: str,
        provider_id: str | None = None,
        at: datetime | None = None,
        market: str | None = None,
        price_usd_per_hr: float | None = None,
        said: Words = (),
        keyed: Keyed | None = None,
    ) -> InstanceRecord:
        """Move the instance to ``to_state`` (and set its provider id, its market and price,
        when given: a launch the provider billed otherwise than asked), with an
        ``instance_events`` row. :class:`InvalidTransitionError` when the lifecycle table does
        not allow the move from the state it is in. ``said``: the decisions of its app that say
        the move (an adoption), written in its transaction; ``keyed``: one more, merged with its
        key's repeats (a launch that failed for good, whose retries failed under the same key
        before)."""
        if market is not None and market not in MARKETS:
            raise InvalidValueError("market", f"must be on-demand or spot, got {market!r}")
        price = None if price_usd_per_hr is None else _number(price_usd_per_hr, "price_usd_per_hr")
        given = {"provider_id": provider_id, "market": market, "price_usd_per_hr": price}
        values = {key: value for key, value in given.items() if value is not None}
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    moved = _try_move(session, instance_id, to_state, reason, now, values)
                    if moved is None:
                        raise _LostRaceError
                    instance, app = moved
                    for kind, text, numbers in said:
                        add_decision(session, instance.app_id, kind, text, numbers, now)
                    add_keyed(session, instance.app_id, keyed, now, self.decision_merge_window_s)
                    return _instance_record(instance, app)
            except _LostRaceError:
                continue
            except IntegrityError:
                raise ConflictError(
                    f"provider id {provider_id!r} is already recorded for another instance"
                ) from None
        raise ConflictError(f"instance {instance_id!r} kept changing state; try again")

    @_translated
    def transition_instances(
        self,
        app: str,
        instance_ids: Sequence[str],
        to_state: str,
        *,
        reason: str,
        said: Words = (),
        at: datetime | None = None,
    ) -> tuple[list[InstanceRecord], list[ControlPlaneError]]:
        """Move ``app``'s instances ``instance_ids`` to ``to_state`` as :meth:`transition_instance`
        does, and write the decisions ``said`` of the app, in one transaction: the moves and the
        words that say them, all or none (a terminate said and its rows not yet moved was said
        again by the reconciler started again). A row another writer moves meanwhile is read
        again and moved from where it is now; one that may not move (ended meanwhile:
        :class:`InvalidTransitionError`; still moving after as many reads as
        :meth:`transition_instance` makes: :class:`ConflictError`) or is gone
        (:class:`NotFoundError`) stays as it is: the moved rows, and the errors of those."""
        now = self._now(at)
        moved: list[InstanceRecord] = []
        failed: list[ControlPlaneError] = []
        with transaction(self._sessions) as session:
            app_id = _app_row(session, app).id
            for instance_id in instance_ids:
                try:
                    moved.append(_move_row(session, instance_id, to_state, reason, now))
                except ControlPlaneError as error:
                    failed.append(error)
            for kind, text, numbers in said:
                add_decision(session, app_id, kind, text, numbers, now)
        return moved, failed

    @_translated
    def touch_instances(self, instance_ids: Iterable[str], *, at: datetime | None = None) -> int:
        """Set ``updated_at`` of the live ones of ``instance_ids`` to now (a heartbeat: a
        profile run says it still owns its workers, :mod:`controlplane.apps.profile_run`);
        how many rows were touched."""
        ids = list(instance_ids)
        if not ids:
            return 0
        with transaction(self._sessions) as session:
            result = session.execute(
                update(m.Instance)
                .where(m.Instance.id.in_(ids), m.Instance.state.in_(_values(LIVE_STATES)))
                .values(updated_at=self._now(at))
                .execution_options(synchronize_session=False)
            )
            return cast(CursorResult[Any], result).rowcount

    @_translated
    def set_prices_now(self, instance_ids: Iterable[str], price_usd_per_hr: float | None) -> int:
        """Record ``price_usd_per_hr`` as the price now of the live ones of ``instance_ids``
        (spot instances whose type's spot price moved since their launch; None: their launch
        price is the price now again); the launch price, the state and ``updated_at`` stay as
        they are. How many rows were written."""
        ids = list(instance_ids)
        price = None if price_usd_per_hr is None else _number(price_usd_per_hr, "price_usd_per_hr")
        written = 0
        with transaction(self._sessions) as session:
            for start in range(0, len(ids), _IN_CHUNK):
                result = session.execute(
                    update(m.Instance)
                    .where(
                        m.Instance.id.in_(ids[start : start + _IN_CHUNK]),
                        m.Instance.state.in_(_values(LIVE_STATES)),
                    )
                    .values(price_now_usd_per_hr=price)
                    .execution_options(synchronize_session=False)
                )
                written += cast(CursorResult[Any], result).rowcount
        return written

    @_translated
    def set_provider_id(self, instance_id: str, provider_id: str) -> InstanceRecord:
        """Record the provider's id of the instance (without a state change)."""
        try:
            with transaction(self._sessions) as session:
                instance, app = _instance_row(session, instance_id)
                instance.provider_id = _label(provider_id, "provider_id")
                instance.updated_at = self._now(None)
                session.flush()
                return _instance_record(instance, app)
        except IntegrityError:
            raise ConflictError(
                f"provider id {provider_id!r} is already recorded for another instance"
            ) from None

    @_translated
    def list_instance_events(
        self,
        *,
        app: str | None = None,
        instance_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = None,
    ) -> list[InstanceEventRecord]:
        with transaction(self._sessions) as session:
            query = select(m.InstanceEvent, m.App.name).join(
                m.Instance, m.Instance.id == m.InstanceEvent.instance_id
            )
            query = query.join(m.App, m.App.id == m.Instance.app_id)
            if app is not None:
                query = query.where(m.Instance.app_id == _app_row(session, app).id)
            if instance_id is not None:
                query = query.where(m.InstanceEvent.instance_id == instance_id)
            if since is not None:
                query = query.where(m.InstanceEvent.at > self._now(since))
            rows = _newest_rows(session, query, m.InstanceEvent.at, m.InstanceEvent.id, limit)
            return [_event_record(event, name) for event, name in rows]
