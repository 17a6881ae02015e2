"""Metric samples: the roll-up's per-app series, and their retention."""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _app_row,
    _label,
    _newest,
    _number,
    _optional_number,
    _translated,
)
from controlplane.db.store.records import (
    MetricSampleRecord,
    _sample_record,
)

__all__ = ["MetricStore"]


class MetricStore(StoreBase):
    """Metric samples (see the module docstring)."""

    @_translated
    def add_metric_sample(
        self,
        app: str,
        *,
        arrival_rate_qps: float,
        fleet_cost_usd_per_hr: float,
        latency_p50_ms: float | None = None,
        latency_p95_ms: float | None = None,
        latency_p99_ms: float | None = None,
        attainment_share: float | None = None,
        gear: str | None = None,
        accuracy: float | None = None,
        at: datetime | None = None,
    ) -> MetricSampleRecord:
        """Record one rolled-up sample of the app's load, latency, SLO attainment and cost."""
        sample = m.MetricSample(
            at=self._now(at),
            arrival_rate_qps=_number(arrival_rate_qps, "arrival_rate_qps"),
            latency_p50_ms=_optional_number(latency_p50_ms, "latency_p50_ms"),
            latency_p95_ms=_optional_number(latency_p95_ms, "latency_p95_ms"),
            latency_p99_ms=_optional_number(latency_p99_ms, "latency_p99_ms"),
            attainment_share=_optional_number(attainment_share, "attainment_share", upper=1.0),
            fleet_cost_usd_per_hr=_number(fleet_cost_usd_per_hr, "fleet_cost_usd_per_hr"),
            gear=None if gear is None else _label(gear, "gear", max_length=64),
            accuracy=_optional_number(accuracy, "accuracy", upper=1.0),
        )
        with transaction(self._sessions) as session:
            sample.app_id = _app_row(session, app).id
            session.add(sample)
            session.flush()
            return _sample_record(sample, app)

    @_translated
    def metric_series(
        self,
        app: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
    ) -> list[MetricSampleRecord]:
        """The app's samples with ``since < at <= until``, oldest first."""
        with transaction(self._sessions) as session:
            query = select(m.MetricSample).where(m.MetricSample.app_id == _app_row(session, app).id)
            if since is not None:
                query = query.where(m.MetricSample.at > self._now(since))
            if until is not None:
                query = query.where(m.MetricSample.at <= self._now(until))
            samples = _newest(session, query, m.MetricSample.at, m.MetricSample.id, limit)
            return [_sample_record(sample, app) for sample in samples]

    @_translated
    def delete_metric_samples(self, *, before: datetime) -> int:
        """Delete every sample older than ``before`` (retention); return how many went."""
        with transaction(self._sessions) as session:
            result = session.execute(
                delete(m.MetricSample).where(m.MetricSample.at < self._now(before))
            )
            return int(cast(CursorResult[Any], result).rowcount)
