"""The pure helpers of ``benchmarks/fidelity/cycle.py``: the count of misses on each side, their
comparison, the grew-and-shrank judgement of a fleet-size series, and the replayed trace."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fidelity.cycle import (
    FleetSample,
    client_late_or_failed,
    compare_counts,
    cycle_trace,
    fleet_judgement,
    fleet_steps,
    rose_then_fell,
    service_late_or_failed,
    totals_delta,
)
from controlplane.service.demo import LOAD_PERIOD_S, load_trace


def test_client_misses_are_the_queries_not_answered_within_the_slo() -> None:
    summary = {"sent": 1000, "answered": 990, "errors": 10, "attainment": 0.975}
    assert client_late_or_failed(summary) == 25  # 10 errors and 15 late answers
    # attainment is a share: its rounding does not lose a query.
    assert client_late_or_failed({"sent": 3, "attainment": 2 / 3}) == 1
    assert client_late_or_failed({"sent": 7, "attainment": None}) == 7


def test_service_misses_are_the_deltas_of_late_refused_timed_out_and_failed() -> None:
    before = {"arrived": 10, "answered": 9, "late": 1, "refused": 1, "timed_out": 0, "failed": 0}
    before |= {"offered": 10, "within_slo": 8}
    after = {"arrived": 110, "answered": 104, "late": 4, "refused": 3, "timed_out": 1}
    after |= {"failed": 2, "offered": 108, "within_slo": 100, "rejected": 2}
    delta = totals_delta(before, after)  # a counter the before lacks (an older service) is 0
    assert delta == {
        "arrived": 100,
        "answered": 95,
        "late": 3,
        "refused": 2,
        "timed_out": 1,
        "failed": 2,
        "offered": 98,
        "rejected": 2,
    }
    assert service_late_or_failed(delta) == 8  # a 422 after arrival is the client's: no miss


def test_the_counts_are_compared_as_a_share_of_all_queries() -> None:
    same = compare_counts(2000, 30, 30)
    assert same["difference"] == 0 and same["difference_share"] == 0.0 and same["within_1pct"]
    edge = compare_counts(2000, 30, 50)  # 20 of 2000: exactly 1%
    assert edge["difference"] == 20
    assert edge["difference_share"] == pytest.approx(0.01)
    assert edge["within_1pct"]
    under = compare_counts(2000, 51, 30)  # the service counts fewer: 21 of 2000
    assert under["difference"] == -21 and not under["within_1pct"]
    with pytest.raises(ValueError, match="queries"):
        compare_counts(0, 0, 0)


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ([3, 3, 5, 6, 4, 3], True),  # grew from 3 to 6, then shrank
        ([3, 2, 2, 4, 5, 4], True),  # shrank first, then grew and shrank
        ([3, 2, 3], False),  # shrank, then grew back: no fall after the rise
        ([3, 4, 5, 5], False),  # grew only
        ([6, 5, 3], False),  # shrank only
        ([4, 4, 4], False),  # flat
        ([], False),
        ([4], False),
        ([2, 5, 4, 6], True),  # the fall from 5 counts though a higher peak follows
    ],
)
def test_grew_and_shrank_needs_a_rise_then_a_fall(series: list[int], expected: bool) -> None:
    assert rose_then_fell(series) is expected


def _samples(running: list[int]) -> list[FleetSample]:
    return [FleetSample(2.0 * n, count, count) for n, count in enumerate(running)]


def test_the_fleet_judgement_needs_the_shape_and_a_launch_and_a_drain() -> None:
    samples = _samples([3, 3, 5, 4])
    judged = fleet_judgement(samples, launches=1, drains=1)
    assert judged == {
        "fleet_min": 3,
        "fleet_max": 5,
        "fleet_first": 3,
        "fleet_last": 4,
        "rose_then_fell": True,
        "grew_and_shrank": True,
    }
    # The same series without a tuner's drain (a worker replaced, say) is not a scale-down.
    assert not fleet_judgement(samples, launches=1, drains=0)["grew_and_shrank"]
    assert not fleet_judgement(_samples([3, 3, 5]), launches=1, drains=1)["grew_and_shrank"]
    empty = fleet_judgement([], launches=2, drains=2)
    assert empty["fleet_min"] is None and not empty["grew_and_shrank"]


def test_fleet_steps_keep_the_changes_and_the_ends() -> None:
    samples = _samples([3, 3, 4, 4, 4, 3, 3])
    assert [(s.t_s, s.running) for s in fleet_steps(samples)] == [
        (0.0, 3),
        (4.0, 4),
        (10.0, 3),
        (12.0, 3),
    ]
    assert fleet_steps([]) == []


def test_the_replayed_trace_is_the_demo_load_period_after_period() -> None:
    one = cycle_trace(1, 500, 0)
    demo = load_trace(0, 500)
    assert np.array_equal(one.arrival_s, demo.arrival_s)
    assert one.sample_id is not None and demo.sample_id is not None
    assert np.array_equal(one.sample_id, demo.sample_id)
    two = cycle_trace(2, 500, 0)
    second = load_trace(1, 500)
    assert len(two) == len(demo) + len(second)
    assert np.array_equal(two.arrival_s[len(demo) :], second.arrival_s + LOAD_PERIOD_S)
    assert np.all(np.diff(two.arrival_s) >= 0)
    # 2.4 to 21.6 qps and back: about 12 qps on average over a period.
    assert len(demo) / LOAD_PERIOD_S == pytest.approx(12.0, rel=0.1)
