"""Interruption notices: an instance the provider is about to take away, said ahead of time.

This module owns :class:`InterruptionNotice` (which instance, what kind of notice, by when it
goes), :class:`InterruptionSource` (a provisioner that tells of them: ``poll_interruptions``),
the reading of EventBridge's EC2 events into notices (:func:`notice_from_event`; the EC2
provisioner's queue reader is :mod:`provisioners.spot`), and :class:`NoticeBoard`, the notices a
provisioner has given and not yet handed out (the local and the fake provisioner's interruption
knob). It needs no cloud client.

>>> notice = notice_from_event({"detail-type": "EC2 Spot Instance Interruption Warning",
...     "time": "2026-11-28T10:00:00Z", "detail": {"instance-id": "i-1", "instance-action":
...     "terminate"}})
>>> notice.kind, notice.provider_id, notice.deadline.isoformat()
('interruption', 'i-1', '2026-11-28T10:02:00+00:00')
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, get_args, runtime_checkable

__all__ = [
    "EVENT_DETAIL_TYPES",
    "INTERRUPTION_NOTICE_S",
    "MARKETS",
    "MARKET_TAG",
    "NOTICE_TIME_WINDOW_S",
    "InterruptionKind",
    "InterruptionNotice",
    "InterruptionSource",
    "Market",
    "NoticeBoard",
    "SpotPriceBoard",
    "SpotPriceSource",
    "notice_from_event",
]

# The tag of a launch request (and its instances) saying which market the reconciler budgeted it
# in: "spot" (spot capacity, at the spot price); "on-demand" (on demand, whatever the EC2
# provisioner's deployment-wide ``spot`` says: an app's on-demand base); absent: on demand, unless
# the deployment-wide ``spot`` says otherwise.
MARKET_TAG = "heteroplane:market"
# The purchase options an instance is launched with (and recorded under).
Market = Literal["on-demand", "spot"]
MARKETS: tuple[Market, ...] = get_args(Market)
# EC2 gives a spot instance two minutes' notice before it interrupts it.
INTERRUPTION_NOTICE_S = 120.0
# A rebalance recommendation comes before any notice; the instance has at least the notice's two
# minutes once one comes, so the reconciler plans with the same deadline.
_REBALANCE_DEADLINE_S = INTERRUPTION_NOTICE_S
# How far ahead of the reader's clock an event's time is believed (clock skew). EventBridge stamps
# an event when it happens, so a later time is no real event's (a forged or corrupt message; year
# 9999 overflowed the deadline), nor is one before the Unix epoch (the reconciler's arithmetic on
# year 1's deadline underflows): such a notice is read as given when it is read, so a warning
# gives the instance two minutes from then. An older time within these bounds is kept: its
# deadline has passed, and the reconciler acts on it at once.
NOTICE_TIME_WINDOW_S = 3600.0
_EARLIEST_TIME = datetime(1970, 1, 1, tzinfo=UTC)
# An instance that AWS is already stopping or terminating: no time left.
_GONE_STATES = frozenset({"stopping", "stopped", "shutting-down", "terminated"})

InterruptionKind = Literal["interruption", "rebalance", "state_change"]

# EventBridge's detail-type of each event the queue receives -> the kind of notice.
EVENT_DETAIL_TYPES: Mapping[str, InterruptionKind] = {
    "EC2 Spot Instance Interruption Warning": "interruption",
    "EC2 Instance Rebalance Recommendation": "rebalance",
    "EC2 Instance State-change Notification": "state_change",
}


@dataclass(frozen=True, slots=True)
class InterruptionNotice:
    """An instance that is about to be (or already is being) taken away.

    ``kind``: ``interruption`` (a spot interruption warning), ``rebalance`` (a rebalance
    recommendation) or ``state_change`` (the instance is stopping or terminating).
    ``deadline``: when the instance goes (the warning's time plus two minutes; for a state change,
    its time). ``state``: the new state of a state change.
    """

    provider_id: str
    kind: InterruptionKind
    at: datetime
    deadline: datetime
    state: str | None = None

    def describe(self) -> str:
        what = {
            "interruption": "spot interruption warning",
            "rebalance": "rebalance recommendation",
            "state_change": f"state change to {self.state}",
        }[self.kind]
        return f"{what} for {self.provider_id} (gone by {self.deadline.isoformat()})"


@runtime_checkable
class InterruptionSource(Protocol):
    """A provisioner that tells of interruptions ahead of time."""

    def poll_interruptions(self) -> list[InterruptionNotice]:
        """The notices since the last call, oldest first (each is returned once)."""
        ...


@runtime_checkable
class SpotPriceSource(Protocol):
    """A provisioner that knows what spot capacity costs now (the EC2 provisioner:
    DescribeSpotPriceHistory, :mod:`provisioners.spot`)."""

    def spot_price(self, instance_type: str) -> float | None:
        """The spot price of ``instance_type`` now, USD/hr, in its cheapest zone (``None``: not
        sold on spot). Raises :class:`~provisioners.errors.ProvisionerError` when it cannot be
        read."""
        ...


def _parse_time(text: object) -> datetime:
    if not isinstance(text, str):
        raise ValueError(f"time must be text, got {text!r}")
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def notice_from_event(
    event: Mapping[str, Any], now: datetime | None = None
) -> InterruptionNotice | None:
    """The notice an EventBridge event says, or ``None`` for an event that is no notice (a
    state change to ``pending`` or ``running``). Raises ``ValueError`` for a malformed one (a
    time whose deadline no date can hold included).

    ``now`` (the reader's clock): an event whose time is more than :data:`NOTICE_TIME_WINDOW_S`
    after it, or before 1970, is read as given at ``now``.

    >>> far = {"detail-type": "EC2 Spot Instance Interruption Warning", "time":
    ...     "9999-12-31T23:59:59Z", "detail": {"instance-id": "i-1"}}
    >>> notice_from_event(far, datetime(2026, 11, 28, 10, tzinfo=UTC)).deadline.isoformat()
    '2026-11-28T10:02:00+00:00'
    """
    kind = EVENT_DETAIL_TYPES.get(str(event.get("detail-type")))
    if kind is None:
        raise ValueError(f"not an interruption event: detail-type {event.get('detail-type')!r}")
    detail = event.get("detail")
    if not isinstance(detail, Mapping) or not isinstance(detail.get("instance-id"), str):
        raise ValueError("the event's detail names no instance-id")
    at = _parse_time(event.get("time"))
    if now is not None and not _EARLIEST_TIME <= at <= now + timedelta(
        seconds=NOTICE_TIME_WINDOW_S
    ):
        at = now
    provider_id = str(detail["instance-id"])
    if kind != "state_change":
        notice_s = INTERRUPTION_NOTICE_S if kind == "interruption" else _REBALANCE_DEADLINE_S
        try:
            deadline = at + timedelta(seconds=notice_s)
        except OverflowError:
            raise ValueError(f"time {at.isoformat()} leaves no room for its deadline") from None
        return InterruptionNotice(provider_id, kind, at, deadline)
    state = str(detail.get("state", ""))
    if state not in _GONE_STATES:
        return None
    return InterruptionNotice(provider_id, kind, at, at, state)


class NoticeBoard:
    """The notices given and not handed out yet (thread-safe), oldest first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notices: list[InterruptionNotice] = []

    def post(
        self, provider_id: str, at: datetime, notice_s: float = INTERRUPTION_NOTICE_S
    ) -> InterruptionNotice:
        """Give a spot interruption warning for ``provider_id`` at ``at``: it goes ``notice_s``
        later."""
        if notice_s < 0:
            raise ValueError(f"notice_s must be >= 0, got {notice_s!r}")
        notice = InterruptionNotice(
            provider_id, "interruption", at, at + timedelta(seconds=notice_s)
        )
        with self._lock:
            self._notices.append(notice)
        return notice

    def take(self) -> list[InterruptionNotice]:
        with self._lock:
            notices, self._notices = self._notices, []
        return notices


class SpotPriceBoard:
    """Spot prices set by hand (thread-safe): the fake and the local provisioner's knob, what
    their ``spot_price`` answers as the EC2 provisioner's DescribeSpotPriceHistory read does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prices: dict[str, float] = {}

    def set(self, instance_type: str, price_usd_per_hr: float | None) -> None:
        """The spot price of ``instance_type`` now (``None``: not known here; the app's catalog's
        serves). Raises ValueError for a price that is negative or not finite."""
        with self._lock:
            if price_usd_per_hr is None:
                self._prices.pop(instance_type, None)
                return
            price = float(price_usd_per_hr)
            if not math.isfinite(price) or price < 0:
                raise ValueError(f"a spot price must be finite and >= 0, got {price_usd_per_hr!r}")
            self._prices[instance_type] = price

    def get(self, instance_type: str) -> float | None:
        with self._lock:
            return self._prices.get(instance_type)
