"""The interruption queue's reader with messages it cannot read: a notice whose time is year 9999
(its deadline overflowed), a body nested too deep for the JSON decoder, sent in one batch with a
genuine warning. Each used to raise out of ``poll`` (OverflowError, RecursionError), leaving the
whole batch undeleted, failing the reconcile tick every time SQS gave it back, and hiding the
genuine warning behind it. Real boto3 against moto's in-process SQS (``mock_aws``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from provisioners.interruptions import (  # noqa: E402
    INTERRUPTION_NOTICE_S,
    NOTICE_TIME_WINDOW_S,
    notice_from_event,
)
from provisioners.spot import InterruptionQueue  # noqa: E402

REGION = "us-east-1"
NOW = datetime(2026, 12, 5, 19, 12, tzinfo=UTC)


def warning(instance_id: str, time: str) -> dict[str, Any]:
    return {
        "detail-type": "EC2 Spot Instance Interruption Warning",
        "time": time,
        "detail": {"instance-id": instance_id, "instance-action": "terminate"},
    }


@pytest.fixture
def sqs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[tuple[Any, str]]:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SQS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    with moto.mock_aws():
        client: Any = boto3.client("sqs", region_name=REGION)
        yield client, str(client.create_queue(QueueName="hp-interruptions")["QueueUrl"])


def test_unreadable_messages_are_deleted_and_the_rest_of_the_batch_is_read(
    sqs: tuple[Any, str], caplog: pytest.LogCaptureFixture
) -> None:
    client, url = sqs
    bodies = [
        json.dumps(warning("i-farfuture", "9999-12-31T23:59:59Z")),
        "[" * 100_000,  # RecursionError in the decoder
        json.dumps(warning("i-genuine", "2026-12-05T19:11:50Z")),
        "{not json",
    ]
    client.send_message_batch(
        QueueUrl=url, Entries=[{"Id": str(i), "MessageBody": b} for i, b in enumerate(bodies)]
    )
    queue = InterruptionQueue(client, url, now=lambda: NOW)
    with caplog.at_level(logging.WARNING, logger="provisioners.spot"):
        notices = queue.poll()
    by_id = {n.provider_id: n for n in notices}
    assert sorted(by_id) == ["i-farfuture", "i-genuine"]
    genuine = by_id["i-genuine"]
    assert genuine.deadline == datetime(2026, 12, 5, 19, 13, 50, tzinfo=UTC)
    # Year 9999 is no real event's time: read as given now, two minutes' notice from now.
    far = by_id["i-farfuture"]
    assert (far.at, far.deadline) == (NOW, NOW + timedelta(seconds=INTERRUPTION_NOTICE_S))
    assert queue.skipped == 2
    malformed = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(malformed) == 2
    assert any("RecursionError" in r.getMessage() for r in malformed)
    # Every message was deleted: nothing comes back, not even after the visibility timeout.
    client.set_queue_attributes(QueueUrl=url, Attributes={"VisibilityTimeout": "0"})
    assert client.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", []) == []
    assert queue.poll() == []


@pytest.mark.parametrize(
    "time",
    [
        "9999-12-31T23:59:59Z",
        "2026-12-05T20:12:01Z",
        "0001-01-01T00:00:00Z",
        "1969-12-31T23:59:59Z",
    ],
)
def test_a_time_far_ahead_of_the_readers_clock_or_before_1970_is_read_as_now(time: str) -> None:
    notice = notice_from_event(warning("i-1", time), NOW)
    assert notice is not None
    assert (notice.at, notice.deadline) == (NOW, NOW + timedelta(seconds=INTERRUPTION_NOTICE_S))


@pytest.mark.parametrize(
    "at",
    [
        NOW + timedelta(seconds=NOTICE_TIME_WINDOW_S),
        NOW - timedelta(days=400),
        datetime(1970, 1, 1, tzinfo=UTC),
    ],
)
def test_a_past_time_or_one_within_the_clock_skew_is_kept(at: datetime) -> None:
    notice = notice_from_event(warning("i-1", at.isoformat()), NOW)
    assert notice is not None and notice.at == at


def test_without_a_clock_a_deadline_no_date_holds_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no room for its deadline"):
        notice_from_event(warning("i-1", "9999-12-31T23:59:59Z"))
