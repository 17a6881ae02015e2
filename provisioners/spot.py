"""Spot on EC2: what spot capacity costs now, and the notices that it is about to go.

Two readers, each over a boto3 client it is given (so a test points them at a moto server):

- :class:`SpotPriceReader` reads the current spot price of instance types with
  ``DescribeSpotPriceHistory`` (Linux/UNIX, the latest price of each type in each availability
  zone) and caches each zone's answer for ``ttl_s``: a planner that asks every tick does not
  call EC2 every tick. :meth:`SpotPriceReader.price` answers for one zone, or the cheapest zone.
- :class:`InterruptionQueue` reads the SQS queue the terraform module feeds from EventBridge
  (``terraform/modules/heteroplane/interruptions.tf``), as Karpenter does: EC2 Spot Instance
  Interruption Warnings (two minutes before the instance goes), EC2 Instance Rebalance
  Recommendations (the instance is at higher risk) and EC2 Instance State-change Notifications.
  Each message becomes one :class:`InterruptionNotice` and is deleted from the queue once read;
  a message that is none of these (or not JSON, or one that cannot be read at all: nested too
  deep to decode, a date out of range) is deleted too, counted in
  :attr:`InterruptionQueue.skipped` and logged once, never raised: one bad message must not
  block the queue, nor the other messages of its batch. An event's time far from the reader's
  clock is read as now (:data:`~provisioners.interruptions.NOTICE_TIME_WINDOW_S`).

The notices themselves are :mod:`provisioners.interruptions`' (no cloud client needed there); a
provisioner that can tell of interruptions implements its ``InterruptionSource``, and the
reconciler asks every tick (docs/spot.md, "Acting on a notice").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from provisioners.boto_errors import BOTO_ERRORS, first_line
from provisioners.errors import ProvisionerError, ThrottledError
from provisioners.interruptions import InterruptionNotice, notice_from_event

__all__ = ["FAILED_READ_RETRY_S", "InterruptionQueue", "SpotPriceReader"]

logger = logging.getLogger(__name__)

# How long a type whose spot price read failed (throttled, no permission) is not read again, s
# (at most the prices' TTL): a read that failed on every tick asked EC2 twice a tick.
FAILED_READ_RETRY_S = 60.0


class InterruptionQueue:
    """Reads the interruption queue (see the module docstring). ``sqs`` is a boto3 SQS client;
    ``wait_s`` is the long poll of one receive (0: answer at once; the reconciler's tick must not
    wait on it); at most ``max_batches`` receives of ten messages per :meth:`poll`; ``now`` the
    clock the notices' times are checked against (injected for tests)."""

    def __init__(
        self,
        sqs: Any,
        queue_url: str,
        *,
        wait_s: int = 0,
        max_batches: int = 10,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        if not queue_url:
            raise ValueError("queue_url must not be empty")
        self.sqs = sqs
        self.queue_url = queue_url
        self.wait_s = wait_s
        self.max_batches = max_batches
        self.now = now if now is not None else (lambda: datetime.now(UTC))
        self.skipped = 0
        self._lock = threading.Lock()

    def poll(self) -> list[InterruptionNotice]:
        """Every notice on the queue now (up to ``max_batches`` x 10 messages), each deleted
        from the queue once read, oldest first. Raises :class:`ThrottledError` or
        :class:`ProvisionerError` when SQS cannot be read."""
        notices: list[InterruptionNotice] = []
        with self._lock:
            for _ in range(self.max_batches):
                messages = self._receive()
                if not messages:
                    break
                for message in messages:
                    notice = self._read(message)
                    if notice is not None:
                        notices.append(notice)
                self._delete(messages)
        return sorted(notices, key=lambda notice: notice.at)

    def _read(self, message: Mapping[str, Any]) -> InterruptionNotice | None:
        body = message.get("Body", "")
        try:
            event = json.loads(str(body))
            if not isinstance(event, Mapping):
                raise ValueError("the body is not a JSON object")
            return notice_from_event(event, self.now())
        except Exception as error:
            # Not JSON, no EC2 notice, no instance-id or time (ValueError), and whatever else one
            # message raises (RecursionError for a body nested too deep to decode, an
            # OverflowError) is that message's fault: skip it, read the rest of its batch.
            self._skip(message, error)
            return None

    def _skip(self, message: Mapping[str, Any], error: Exception) -> None:
        self.skipped += 1
        logger.warning(
            "interruption queue: message %s is malformed; deleted unread (%s: %s)",
            message.get("MessageId", "?"),
            type(error).__name__,
            first_line(error, 160),
        )

    def _receive(self) -> list[Mapping[str, Any]]:
        try:
            answer = self.sqs.receive_message(
                QueueUrl=self.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=self.wait_s
            )
        except BOTO_ERRORS as error:
            raise _boto_error("ReceiveMessage", error) from None
        return list(answer.get("Messages", []))

    def _delete(self, messages: Sequence[Mapping[str, Any]]) -> None:
        entries = [
            {"Id": str(index), "ReceiptHandle": message["ReceiptHandle"]}
            for index, message in enumerate(messages)
        ]
        try:
            self.sqs.delete_message_batch(QueueUrl=self.queue_url, Entries=entries)
        except BOTO_ERRORS as error:
            raise _boto_error("DeleteMessageBatch", error) from None


def _boto_error(operation: str, error: Exception) -> ProvisionerError:
    code = (
        str(error.response.get("Error", {}).get("Code", ""))
        if isinstance(error, ClientError)
        else ""
    )
    if "Throttl" in code:
        return ThrottledError(f"{operation}: {error}")
    return ProvisionerError(f"{operation}: {first_line(error)}")


class SpotPriceReader:
    """Current spot prices per (type, zone) from ``DescribeSpotPriceHistory``, cached per zone.

    ``ec2`` is a boto3 EC2 client; ``ttl_s`` how long a zone's prices are kept; ``clock`` a
    monotonic clock in seconds (injected for tests). A type is fetched for every zone at once
    (one call, paginated); its prices then serve every zone for ``ttl_s``. An answer with no
    price for a type is kept for ``ttl_s`` as well (:meth:`price` answers ``None``), and
    ``on_unpriced`` is told those types once per read. A read that fails is not made again for
    :data:`FAILED_READ_RETRY_S` (at most ``ttl_s``): its error is raised again meanwhile.
    """

    def __init__(
        self,
        ec2: Any,
        *,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        product: str = "Linux/UNIX",
        on_unpriced: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s!r}")
        self.ec2 = ec2
        self.ttl_s = ttl_s
        self.clock = clock
        self.product = product
        self.on_unpriced = on_unpriced
        self.calls = 0  # DescribeSpotPriceHistory calls made (pages counted once per call)
        # A failed read (throttled, no permission) is not asked again for a while: its error
        # is raised again until then (each caller falls back to the catalog's prices).
        self.retry_s = min(ttl_s, FAILED_READ_RETRY_S)
        self._failed: dict[str, tuple[float, ProvisionerError]] = {}  # type -> (when, error)
        self._zones: dict[str, dict[str, float]] = {}  # zone -> instance type -> USD/hr
        self._fetched_s: dict[str, float] = {}  # instance type -> when it was last fetched
        self._lock = threading.Lock()

    def prices(self, instance_types: Iterable[str]) -> dict[tuple[str, str], float]:
        """(type, zone) -> the current spot price in USD/hr, for each zone that sells the type."""
        wanted = sorted(set(instance_types))
        with self._lock:
            now = self.clock()
            stale = [t for t in wanted if now - self._fetched_s.get(t, -float("inf")) > self.ttl_s]
            if stale:
                recent = [
                    self._failed[t]
                    for t in stale
                    if t in self._failed and now - self._failed[t][0] < self.retry_s
                ]
                if len(recent) == len(stale):
                    raise recent[0][1]
                try:
                    self._fetch(stale, now)
                except ProvisionerError as error:
                    for instance_type in stale:
                        self._failed[instance_type] = (now, error)
                    raise
                for instance_type in stale:
                    self._failed.pop(instance_type, None)
            return {
                (instance_type, zone): prices[instance_type]
                for zone, prices in sorted(self._zones.items())
                for instance_type in wanted
                if instance_type in prices
            }

    def price(self, instance_type: str, zone: str | None = None) -> float | None:
        """The spot price of ``instance_type`` in ``zone`` (``None``: the cheapest zone), or
        ``None`` when no zone sells it on spot."""
        found = {
            z: price for (_, z), price in self.prices([instance_type]).items() if zone in (None, z)
        }
        return min(found.values()) if found else None

    def _fetch(self, instance_types: Sequence[str], now: float) -> None:
        latest: dict[tuple[str, str], tuple[datetime, float]] = {}
        token = ""
        self.calls += 1
        while True:
            kwargs: dict[str, Any] = {
                "InstanceTypes": list(instance_types),
                "ProductDescriptions": [self.product],
                "StartTime": datetime.now(UTC),
            }
            if token:
                kwargs["NextToken"] = token
            try:
                answer = self.ec2.describe_spot_price_history(**kwargs)
            except BOTO_ERRORS as error:
                raise _boto_error("DescribeSpotPriceHistory", error) from None
            for entry in answer.get("SpotPriceHistory", []):
                key = (str(entry["InstanceType"]), str(entry["AvailabilityZone"]))
                stamp = entry.get("Timestamp") or datetime.min.replace(tzinfo=UTC)
                if key not in latest or stamp > latest[key][0]:
                    latest[key] = (stamp, float(entry["SpotPrice"]))
            token = str(answer.get("NextToken") or "")
            if not token:
                break
        for instance_type in instance_types:
            self._fetched_s[instance_type] = now
        unpriced = sorted(set(instance_types) - {t for t, _ in latest})
        if unpriced and self.on_unpriced is not None:
            self.on_unpriced(unpriced)
        # The answer replaces what was known of these types in every zone: a zone that no
        # longer sells one on spot drops it.
        fetched = set(instance_types)
        by_zone: dict[str, dict[str, float]] = {
            zone: {t: p for t, p in prices.items() if t not in fetched}
            for zone, prices in self._zones.items()
        }
        for (instance_type, zone), (_, price) in latest.items():
            by_zone.setdefault(zone, {})[instance_type] = price
        self._zones = {zone: prices for zone, prices in by_zone.items() if prices}
