"""The rollout's pure parts: the state table, the steps, the split by request id, the extra
fleet and the judgement after each interval."""

from __future__ import annotations

import pytest

from controlplane.errors import InvalidRolloutTransitionError, InvalidValueError
from controlplane.policies.rollout import (
    ACTIVE_STATES,
    Judgement,
    RolloutState,
    Thresholds,
    Verdict,
    VersionFigures,
    bucket,
    check_rollout_transition,
    extra_fleet,
    judge,
    parse_steps,
    routed_to_new,
    step_fleet,
    step_shares,
)

T = Thresholds(min_queries=20)


def _judgement(
    figures: VersionFigures,
    *,
    shadow: bool = False,
    last: bool = False,
    elapsed_s: float = 200.0,
    thresholds: Thresholds = T,
) -> Judgement:
    return judge(
        figures=figures,
        shadow_step=shadow,
        last_step=last,
        elapsed_s=elapsed_s,
        interval_s=120.0,
        slo_ms=100.0,
        thresholds=thresholds,
    )


def _judge(
    figures: VersionFigures, *, shadow: bool = False, last: bool = False, elapsed_s: float = 200.0
) -> Verdict:
    return _judgement(figures, shadow=shadow, last=last, elapsed_s=elapsed_s).verdict


def test_terminal_states_have_no_moves_and_are_not_active() -> None:
    for state in (RolloutState.PROMOTED, RolloutState.ROLLED_BACK, RolloutState.ABORTED):
        assert state not in ACTIVE_STATES
        with pytest.raises(InvalidRolloutTransitionError):
            check_rollout_transition(state.value, RolloutState.RUNNING.value)
    check_rollout_transition("paused", "running")
    with pytest.raises(InvalidRolloutTransitionError):
        check_rollout_transition("nonsense", "running")


@pytest.mark.parametrize("text", ["", "5,5,100", "50,20,100", "5,25", "0,100", "5,x,100", "5,150"])
def test_bad_steps_are_refused(text: str) -> None:
    with pytest.raises(InvalidValueError, match="steps"):
        parse_steps(text)


def test_steps_are_shares() -> None:
    assert parse_steps("100") == (1.0,)
    assert parse_steps("10,100") == (0.1, 1.0)


@pytest.mark.parametrize("shares", [[1e-300, 1.0], [0.0000001, 1.0], [0.1000001, 0.1000002, 1.0]])
def test_steps_are_checked_as_they_are_kept(shares: list[float]) -> None:
    """Kept to six places, then checked: 1e-300 was stored as 0 (a shadow step) and two steps
    that round alike as a step that does not increase."""
    with pytest.raises(InvalidValueError, match="steps"):
        step_shares(shares)
    assert step_shares([0.0000051, 1.0]) == (0.000005, 1.0)


def test_split_is_deterministic_and_close_to_the_share() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    assert [routed_to_new(i, 0.25) for i in ids[:50]] == [routed_to_new(i, 0.25) for i in ids[:50]]
    share = sum(routed_to_new(i, 0.25) for i in ids) / len(ids)
    assert 0.23 < share < 0.27
    # A query on the new version at one step stays there at the next, larger one.
    assert all(routed_to_new(i, 0.5) for i in ids if routed_to_new(i, 0.25))
    assert not any(routed_to_new(i, 0.0) for i in ids[:100])
    assert all(0.0 <= bucket(i) < 1.0 for i in ids[:100])


def test_a_steps_fleet_follows_its_share_and_only_grows() -> None:
    prices = {"small": 1.0, "large": 3.0}
    stages = {"small": 8, "large": 2}
    shares = (0.05, 0.25, 0.5, 1.0)
    fleets = []
    granted: dict[str, int] = {}
    for index in range(len(shares)):
        granted = step_fleet(stages, prices, shares, index, granted)
        fleets.append(granted)
    assert fleets == [
        {"large": 1, "small": 1},
        {"large": 1, "small": 2},
        {"large": 1, "small": 4},
        {"large": 2, "small": 8},
    ]
    # A shadow step (share 0) mirrors every query: the whole stage; the next keeps it.
    assert step_fleet(stages, prices, (0.0, 0.25, 1.0), 0, {}) == stages
    assert step_fleet(stages, prices, (0.0, 0.25, 1.0), 1, stages) == stages
    # No stage fleet (no plan): one of the cheapest type.
    assert step_fleet({}, prices, shares, 3, {}) == {"small": 1}


def test_extra_fleet_rounds_up_and_keeps_one() -> None:
    prices = {"small": 0.1, "large": 1.0}
    assert extra_fleet({"small": 3, "large": 2}, prices, 1.0) == {"large": 2, "small": 3}
    assert extra_fleet({"small": 3, "large": 2}, prices, 0.5) == {"large": 1, "small": 2}
    assert extra_fleet({"small": 0}, prices, 0.05) == {"small": 1}


def test_a_good_version_promotes_after_the_interval_and_completes_at_the_last_step() -> None:
    good = VersionFigures(queries=100, errors=0, p99_ms=80.0)
    assert _judge(good, elapsed_s=60.0) is Verdict.HOLD
    assert _judge(good) is Verdict.PROMOTE
    assert _judge(good, last=True) is Verdict.COMPLETE


def test_too_few_queries_hold() -> None:
    assert _judge(VersionFigures(queries=5, p99_ms=10.0)) is Verdict.HOLD
    assert _judge(VersionFigures(), shadow=True) is Verdict.HOLD


def test_slow_version_rolls_back_at_once() -> None:
    slow = VersionFigures(queries=40, errors=0, p99_ms=150.0)
    assert _judge(slow, elapsed_s=1.0) is Verdict.ROLL_BACK
    # ... but not on a handful of queries
    assert _judge(VersionFigures(queries=3, p99_ms=150.0), elapsed_s=1.0) is Verdict.HOLD


def test_errors_roll_back() -> None:
    assert _judge(VersionFigures(queries=100, errors=5, p99_ms=50.0), elapsed_s=1.0) is (
        Verdict.ROLL_BACK
    )


def test_an_error_share_over_its_limit_decides_on_the_evidence() -> None:
    """Before ``min_queries``, an error share over the limit rolls back only where the sample
    leaves no doubt (its least likely share, the Wilson bound, over the limit): two errors in
    the first three queries did at a limit of a half, by chance as often as not. One error in
    the first query still decides the default 1%, and with ``min_queries`` sent the share
    itself decides."""
    half = Thresholds(max_error_share=0.5, min_queries=20)

    def verdict(queries: int, errors: int, thresholds: Thresholds) -> Verdict:
        figures = VersionFigures(queries=queries, errors=errors, p99_ms=50.0)
        return _judgement(figures, elapsed_s=1.0, thresholds=thresholds).verdict

    assert verdict(3, 2, half) is Verdict.HOLD
    assert verdict(8, 8, half) is Verdict.ROLL_BACK  # no doubt left
    assert verdict(20, 11, half) is Verdict.ROLL_BACK  # min_queries sent: the share decides
    assert verdict(19, 11, half) is Verdict.HOLD
    assert verdict(1, 1, Thresholds()) is Verdict.ROLL_BACK
    judged = _judgement(
        VersionFigures(queries=20, errors=11, p99_ms=50.0), elapsed_s=1.0, thresholds=half
    )
    assert judged.reason.startswith("error share 0.550 (11 of 20 queries) over the limit 0.5")


def test_disagreement_in_shadow_rolls_back() -> None:
    wrong = VersionFigures(queries=100, p99_ms=50.0, compared=100, agreed=60)
    assert _judge(wrong, shadow=True, elapsed_s=1.0) is Verdict.ROLL_BACK
    right = VersionFigures(queries=100, p99_ms=50.0, compared=100, agreed=99)
    assert _judge(right, shadow=True) is Verdict.PROMOTE


def test_accuracy_under_the_floor_rolls_back_only_when_asked_and_measured() -> None:
    """With ``min_accuracy`` set and ``min_queries`` labelled samples answered, an accuracy
    under it rolls back at once; without the floor, or with too few labelled samples, the same
    figures promote (or hold on the interval)."""
    floor = Thresholds(min_queries=20, min_accuracy=0.9)

    def verdict(figures: VersionFigures, thresholds: Thresholds, elapsed_s: float) -> Verdict:
        return _judgement(figures, elapsed_s=elapsed_s, thresholds=thresholds).verdict

    wrong = VersionFigures(queries=100, p99_ms=50.0, labelled=40, correct=30)  # 0.75
    judged = _judgement(wrong, elapsed_s=1.0, thresholds=floor)
    assert judged.verdict is Verdict.ROLL_BACK
    assert judged.reason == "accuracy 0.750 (30 of 40 labelled samples) under the limit 0.9"
    assert verdict(wrong, T, elapsed_s=200.0) is Verdict.PROMOTE  # no floor: not judged
    few = VersionFigures(queries=100, p99_ms=50.0, labelled=10, correct=5)
    assert verdict(few, floor, elapsed_s=200.0) is Verdict.PROMOTE  # too few labels to judge
    unlabelled = VersionFigures(queries=100, p99_ms=50.0)
    assert verdict(unlabelled, floor, elapsed_s=200.0) is Verdict.PROMOTE
    right = VersionFigures(queries=100, p99_ms=50.0, labelled=40, correct=38)  # 0.95
    assert verdict(right, floor, elapsed_s=200.0) is Verdict.PROMOTE
    with pytest.raises(InvalidValueError, match="min_accuracy"):
        Thresholds(min_accuracy=1.5)


def test_user_thresholds_are_checked() -> None:
    with pytest.raises(InvalidValueError, match="max_error_share"):
        Thresholds(max_error_share=2.0)
    with pytest.raises(InvalidValueError, match="max_p99_ms"):
        Thresholds(max_p99_ms=-1.0)
    loose = Thresholds(max_p99_ms=500.0, min_queries=20)
    figures = VersionFigures(queries=100, p99_ms=150.0)
    assert (
        judge(
            figures=figures,
            shadow_step=False,
            last_step=False,
            elapsed_s=200,
            interval_s=120,
            slo_ms=100,
            thresholds=loose,
        ).verdict
        is Verdict.PROMOTE
    )


def test_thresholds_fall_back_to_the_most_accurate_when_no_floor_is_met() -> None:
    import numpy as np

    from controlplane.policies.rollout import rederive_thresholds
    from estimator.cascades import synthetic_validation

    records = synthetic_validation(np.random.default_rng(1), [0.7, 0.9], n_samples=300)
    compute = {records.models[0]: 1.0, records.models[1]: 5.0}
    reachable = rederive_thresholds(records, records.models, compute, grid=(0.3, 0.6, 0.9))
    unreachable = rederive_thresholds(
        records, records.models, compute, accuracy_floor=1.01, grid=(0.3, 0.6, 0.9)
    )
    assert reachable.meets_floor and not unreachable.meets_floor
    assert unreachable.in_sample_accuracy >= reachable.in_sample_accuracy
    assert unreachable.held_out_samples == reachable.held_out_samples == 150


def test_the_timing_alone_tells_workers_of_one_type_apart() -> None:
    """Two workers of one type timed alone: each is named by its type and id (a reader saw
    ``emu.cpu.small`` twice with two figures); a type alone is named by its type."""
    from controlplane.loops.rollouts import _alone_text

    timed = {"p99_ms": 3.0, "mean_ms": 2.0}
    text = _alone_text(
        {
            "workers": {
                "d6e5a574-aaaa": {"instance_type": "emu.cpu.small", **timed},
                "46efa399-bbbb": {"instance_type": "emu.cpu.small", **timed},
                "adb8269f-cccc": {"instance_type": "emu.cpu.large", **timed},
            }
        }
    )
    assert "emu.cpu.small d6e5a574: P99 3.0 ms" in text
    assert "emu.cpu.small 46efa399: P99 3.0 ms" in text
    assert "emu.cpu.large: P99 3.0 ms" in text
