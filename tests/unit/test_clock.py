"""The clocks: the fake moves only by hand, never backwards; both satisfy the Clock protocol."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest

from controlplane.clock import FAKE_EPOCH, Clock, FakeClock, SystemClock


def test_both_clocks_satisfy_the_protocol() -> None:
    assert isinstance(SystemClock(), Clock)
    assert isinstance(FakeClock(), Clock)


def test_system_clock_is_monotonic_and_aware_utc() -> None:
    clock = SystemClock()
    first, second = clock.now_s(), clock.now_s()
    assert second >= first
    now = clock.utcnow()
    assert now.tzinfo is not None
    assert now.utcoffset() == timedelta(0)


def test_fake_clock_moves_only_by_hand() -> None:
    clock = FakeClock(start_s=10.0)
    assert clock.now_s() == clock.now_s() == 10.0
    assert clock.utcnow() == FAKE_EPOCH
    clock.advance(1.5)
    assert clock.now_s() == 11.5
    assert clock.utcnow() == FAKE_EPOCH + timedelta(seconds=1.5)
    clock.set_s(20.0)
    assert clock.now_s() == 20.0
    assert clock.utcnow() == FAKE_EPOCH + timedelta(seconds=10.0)


def test_fake_clock_wall_time_is_utc_whatever_zone_it_starts_in() -> None:
    start = datetime(2024, 6, 1, 12, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    clock = FakeClock(start_utc=start)
    assert clock.utcnow().utcoffset() == timedelta(0)
    assert clock.utcnow() == datetime(2024, 6, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_fake_clock_refuses_to_go_back_or_jump_to_infinity(seconds: float) -> None:
    clock = FakeClock()
    with pytest.raises(ValueError):
        clock.advance(seconds)
    assert clock.now_s() == 0.0


def test_fake_clock_set_cannot_go_back() -> None:
    clock = FakeClock(start_s=5.0)
    with pytest.raises(ValueError):
        clock.set_s(4.0)


def test_fake_clock_needs_an_aware_start() -> None:
    with pytest.raises(ValueError):
        FakeClock(start_utc=datetime(2024, 1, 1))  # naive on purpose
