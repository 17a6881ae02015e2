"""The front door's throttle (:class:`~controlplane.serving.throttle.FrontThrottle`): it refuses
only for an app whose admission refused lately, converges past saturation to letting through K
queries per query admitted, and lets everything through again once the load falls."""

from __future__ import annotations

import random

import pytest

from controlplane.serving.throttle import MAX_APPS, FrontThrottle

# The queue admission lets build up, in seconds of work (an SLO of 50 ms).
QUEUE_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _overload(
    throttle: FrontThrottle, clock: Clock, rate_qps: float, capacity_qps: float, seconds: float
) -> tuple[int, int, int]:
    """``rate_qps`` queries a second at the front for ``seconds``; admission admits those let
    through while its queue holds under ``QUEUE_S`` of work at ``capacity_qps`` (a token
    bucket: what the SLO lets queue) and refuses the rest. Returns (refused at the front,
    refused by admission, admitted) over the last second."""
    step = 1.0 / rate_qps
    budget = 0.0
    depth = capacity_qps * QUEUE_S
    last: list[str] = []
    for _ in range(round(seconds * rate_qps)):
        clock.now += step
        budget = min(budget + capacity_qps * step, depth)
        if throttle.refuse("app"):
            last.append("front")
            continue
        admitted = budget >= 1.0
        if admitted:
            budget -= 1.0
        throttle.answered("app", admitted)
        last.append("admitted" if admitted else "admission")
    tail = last[-round(rate_qps) :]
    return tail.count("front"), tail.count("admission"), tail.count("admitted")


def test_an_app_never_refused_by_admission_is_never_refused_at_the_front() -> None:
    clock = Clock()
    throttle = FrontThrottle(clock, rng=random.Random(1))
    assert not throttle.refuse("app")  # never answered here: nothing known
    throttle.answered("app", True)
    for _ in range(1000):  # requests far past what was admitted, but no refusal
        clock.now += 0.001
        assert not throttle.refuse("app")
    assert throttle.share("app") == 0.0 and throttle.share("other") == 0.0


def test_past_saturation_admission_sees_k_times_what_it_admits() -> None:
    clock = Clock()
    throttle = FrontThrottle(clock, k=1.25, rng=random.Random(2))
    throttle.answered("app", True)
    front, admission, admitted = _overload(throttle, clock, 2000.0, 500.0, 10.0)
    assert admitted == pytest.approx(500, rel=0.05)
    # 2000 a second, 500 admitted: the front refuses about 2000 - 1.25 x 500 = 1375 of them,
    # admission the other 125 that reach it.
    assert front == pytest.approx(1375, rel=0.08)
    assert admission == pytest.approx(125, rel=0.5)
    assert throttle.share("app") == pytest.approx(1375 / 2000, abs=0.05)


def test_once_the_load_falls_under_capacity_nothing_is_refused_at_the_front() -> None:
    clock = Clock()
    throttle = FrontThrottle(clock, rng=random.Random(3))
    throttle.answered("app", True)
    _overload(throttle, clock, 2000.0, 500.0, 5.0)
    assert throttle.share("app") > 0.5
    front, admission, admitted = _overload(throttle, clock, 300.0, 500.0, 10.0)
    assert (front, admission, admitted) == (0, 0, 300)
    assert throttle.share("app") == 0.0


def test_the_apps_tracked_are_bounded_and_bad_settings_refused() -> None:
    clock = Clock()
    throttle = FrontThrottle(clock)
    for i in range(MAX_APPS + 5):
        throttle.answered(f"app-{i}", False)
    assert len(throttle._apps) == MAX_APPS and "app-0" not in throttle._apps
    for kwargs in ({"k": 0.9}, {"k": float("inf")}, {"window_s": 0.0}, {"window_s": -1.0}):
        with pytest.raises(ValueError):
            FrontThrottle(clock, **kwargs)  # type: ignore[arg-type]
