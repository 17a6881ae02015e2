"""What the online calibration learns of an app: profile scales, the serving overhead, and
its measured latency profiles."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _app_row,
    _json_document,
    _label,
    _translated,
)
from controlplane.db.store.decisions import Keyed, Words, add_decision, add_keyed
from controlplane.db.store.records import (
    ProfileScaleRecord,
    ServingOverheadRecord,
    _overhead_record,
)
from controlplane.errors import InvalidValueError
from controlplane.policies.calibration import OVERHEAD_QUANTILES

__all__ = ["CalibrationStore"]


def _scale_record(app: str, row: m.ProfileScale) -> ProfileScaleRecord:
    return ProfileScaleRecord(
        app, row.model, row.instance_type, row.factor, row.updated_at, tuple(row.spread or ())
    )


class CalibrationStore(StoreBase):
    """Profile scales, serving overheads and measured profiles (see the module docstring)."""

    # --- profile scales (online calibration) ----------------------------------------------------

    @_translated
    def set_profile_scale(
        self,
        app: str,
        model: str,
        instance_type: str,
        factor: float,
        *,
        said: Keyed | None = None,
        at: datetime | None = None,
    ) -> ProfileScaleRecord:
        """Set the calibration factor of ``model`` on ``instance_type`` for ``app`` (finite,
        > 0; it replaces the one before; a stored spread stays). ``said``: the decision that
        says it, written in the same transaction: a crash between the two would leave the
        factor stored and never said (the loop started again measures against it: no drift)."""
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 0):
            raise InvalidValueError("factor", f"must be finite and > 0, got {factor!r}")
        return self._update_scale(app, model, instance_type, at, said, factor=float(factor))

    @_translated
    def set_profile_spread(
        self,
        app: str,
        model: str,
        instance_type: str,
        spread: Sequence[float],
        *,
        said: Keyed | None = None,
        at: datetime | None = None,
    ) -> ProfileScaleRecord:
        """Set the live round trips' unit-mean shape of ``model`` on ``instance_type`` for
        ``app``: its quantiles at :data:`~controlplane.policies.calibration.OVERHEAD_QUANTILES`
        (finite, > 0, non-decreasing); the factor stays (1 when none was stored). ``said``: as
        :meth:`set_profile_scale`'s."""
        values = [float(q) for q in spread]
        if (
            len(values) != len(OVERHEAD_QUANTILES)
            or not all(math.isfinite(q) and q > 0 for q in values)
            or any(b < a for a, b in itertools.pairwise(values))
        ):
            raise InvalidValueError(
                "spread",
                f"must be {len(OVERHEAD_QUANTILES)} quantiles, finite, > 0 and non-decreasing",
            )
        return self._update_scale(app, model, instance_type, at, said, spread=values)

    def _update_scale(
        self,
        app: str,
        model: str,
        instance_type: str,
        at: datetime | None,
        said: Keyed | None,
        **values: Any,
    ) -> ProfileScaleRecord:
        """Set ``values`` (columns of ``profile_scales``) on the pair's row, made with the
        factor 1 and no spread when there is none yet; ``said`` with it."""
        model = _label(model, "model", max_length=m.PROFILE_SCALE_MODEL_MAX)
        instance_type = _label(instance_type, "instance_type", max_length=m.PROFILE_SCALE_TYPE_MAX)
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            scale = session.scalar(
                select(m.ProfileScale).where(
                    m.ProfileScale.app_id == row.id,
                    m.ProfileScale.model == model,
                    m.ProfileScale.instance_type == instance_type,
                )
            )
            if scale is None:
                scale = m.ProfileScale(
                    app_id=row.id, model=model, instance_type=instance_type, factor=1.0
                )
                session.add(scale)
            for name, value in values.items():
                setattr(scale, name, value)
            scale.updated_at = now
            session.flush()
            self._said(session, row.id, said, now)
            return _scale_record(app, scale)

    def _said(self, session: Session, app_id: int, said: Keyed | None, now: datetime) -> None:
        add_keyed(session, app_id, said, now, self.decision_merge_window_s)

    @_translated
    def list_profile_scales(self, app: str) -> list[ProfileScaleRecord]:
        """The calibration factors (and spreads) of ``app``, by model then instance type."""
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            scales = session.scalars(
                select(m.ProfileScale)
                .where(m.ProfileScale.app_id == row.id)
                .order_by(m.ProfileScale.model, m.ProfileScale.instance_type)
            )
            return [_scale_record(app, s) for s in scales]

    @_translated
    def set_serving_overhead(
        self,
        app: str,
        overhead_ms: float,
        samples: int,
        *,
        quantiles_ms: Sequence[float] = (),
        cpu_ms: float | None = None,
        said: Keyed | None = None,
        at: datetime | None = None,
    ) -> ServingOverheadRecord:
        """Set ``app``'s measured control-plane overhead per query (ms, finite, >= 0) over
        ``samples`` (>= 1) answered queries, with its distribution ``quantiles_ms`` (finite,
        >= 0, non-decreasing; may be empty) and the serving process's CPU per query ``cpu_ms``
        (finite, >= 0; None: not measured); it replaces the one before. ``said``: as
        :meth:`set_profile_scale`'s."""
        if cpu_ms is not None and not (
            isinstance(cpu_ms, int | float) and math.isfinite(cpu_ms) and cpu_ms >= 0
        ):
            raise InvalidValueError("cpu_ms", f"must be finite and >= 0, got {cpu_ms!r}")
        if not (
            isinstance(overhead_ms, int | float) and math.isfinite(overhead_ms) and overhead_ms >= 0
        ):
            raise InvalidValueError("overhead_ms", f"must be finite and >= 0, got {overhead_ms!r}")
        quantiles = [float(q) for q in quantiles_ms]
        if not all(math.isfinite(q) and q >= 0 for q in quantiles) or any(
            b < a for a, b in itertools.pairwise(quantiles)
        ):
            raise InvalidValueError("quantiles_ms", "must be finite, >= 0 and non-decreasing")
        if not (isinstance(samples, int) and samples >= 1):
            raise InvalidValueError("samples", f"must be an integer >= 1, got {samples!r}")
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.scalar(
                select(m.ServingOverhead).where(m.ServingOverhead.app_id == row.id)
            )
            if found is None:
                found = m.ServingOverhead(app_id=row.id)
                session.add(found)
            found.overhead_ms = float(overhead_ms)
            found.samples = samples
            found.updated_at = now
            found.quantiles_ms = quantiles or None
            found.cpu_ms = None if cpu_ms is None else float(cpu_ms)
            session.flush()
            self._said(session, row.id, said, now)
            return _overhead_record(app, found)

    @_translated
    def get_serving_overhead(self, app: str) -> ServingOverheadRecord | None:
        """``app``'s measured control-plane overhead per query, None before any was measured."""
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.scalar(
                select(m.ServingOverhead).where(m.ServingOverhead.app_id == row.id)
            )
            if found is None:
                return None
            return _overhead_record(app, found)

    # --- measured profiles ---

    @_translated
    def put_app_profiles(
        self,
        app: str,
        document: Mapping[str, Any],
        *,
        said: Words = (),
        at: datetime | None = None,
    ) -> None:
        """Store ``app``'s measured latency profiles (a profile JSON document), replacing the
        ones before; :class:`NotFoundError` for an app not registered. ``said``: the decisions
        that say it, written in the same transaction (a profile run's: a crash between the two
        left the profiles stored and never said)."""
        stored = _json_document(document, "document")
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.get(m.AppProfiles, row.id)
            if found is None:
                session.add(m.AppProfiles(app_id=row.id, document=stored, measured_at=now))
            else:
                found.document = stored
                found.measured_at = now
            for kind, text, numbers in said:
                add_decision(session, row.id, kind, text, numbers, now)

    @_translated
    def delete_app_profiles(self, app: str) -> None:
        """Forget ``app``'s measured latency profiles (the app is then unprofiled, as before its
        first run); :class:`NotFoundError` for an app not registered."""
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.get(m.AppProfiles, row.id)
            if found is not None:
                session.delete(found)

    @_translated
    def get_app_profiles(self, app: str) -> dict[str, Any] | None:
        """``app``'s measured latency profiles; None when none were measured (or no such app
        is registered: an app being registered has none yet)."""
        with transaction(self._sessions) as session:
            found = session.execute(
                select(m.AppProfiles.document)
                .join(m.App, m.App.id == m.AppProfiles.app_id)
                .where(m.App.name == app)
            ).scalar_one_or_none()
            return None if found is None else dict(found)
