"""The reach meter (controlplane.serving.reach): the share of an app's samples that reach each
model of its cascade at the spec's thresholds, from the answers of a window."""

from __future__ import annotations

import pytest

from controlplane.serving.reach import ReachMeter


def test_a_later_models_reach_is_the_product_of_the_shares_below_before_it() -> None:
    meter = ReachMeter(("a", "b", "c"), (0.5, 0.8))
    meter.add("a", 10.0, seen=200, below=50)
    meter.add("b", 10.0, seen=40, below=30)
    meter.add("c", 10.0, seen=30, below=30)  # the last model has no threshold: not counted
    reach = meter.reach(11.0)
    assert reach["b"] == (pytest.approx(0.25), 200)
    # b saw 40 of the 50 that a's share sends it: they stand for 160 of a's samples.
    assert reach["c"] == (pytest.approx(0.25 * 0.75), 160)
    assert "a" not in reach
    assert meter.spec("c") is None and meter.spec("a") == (0, 0.5)


def test_a_model_with_no_answers_in_the_window_leaves_the_ones_after_it_unknown() -> None:
    meter = ReachMeter(("a", "b", "c"), (0.5, 0.8))
    meter.add("a", 0.0, seen=10, below=5)
    assert set(meter.reach(1.0)) == {"b"}  # b answered nothing: c's reach is not known


def test_answers_older_than_the_window_are_dropped() -> None:
    meter = ReachMeter(("a", "b"), (0.5,), window_s=60.0, buckets=12)
    meter.add("a", 0.0, seen=100, below=100)
    meter.add("a", 50.0, seen=100, below=0)
    assert meter.reach(55.0)["b"] == (pytest.approx(0.5), 200)
    assert meter.reach(100.0)["b"] == (pytest.approx(0.0), 100)  # the first bucket has aged out
    assert meter.reach(200.0) == {}


def test_a_model_outside_the_specs_cascade_and_empty_counts_are_ignored() -> None:
    meter = ReachMeter(("a", "b"), (0.5,))
    meter.add("other", 0.0, seen=10, below=10)
    meter.add("a", 0.0, seen=0, below=0)
    assert meter.reach(1.0) == {}


@pytest.mark.parametrize(
    ("models", "thresholds", "window_s", "buckets"),
    [
        (("a", "b"), (), 60.0, 12),
        (("a",), (0.5,), 60.0, 12),
        (("a", "b"), (0.5,), 0.0, 12),
        (("a", "b"), (0.5,), float("nan"), 12),
        (("a", "b"), (0.5,), 60.0, 0),
    ],
)
def test_a_meter_refuses_a_shape_it_cannot_count(
    models: tuple[str, ...], thresholds: tuple[float, ...], window_s: float, buckets: int
) -> None:
    with pytest.raises(ValueError):
        ReachMeter(models, thresholds, window_s=window_s, buckets=buckets)


def test_a_third_models_reach_rests_on_no_more_samples_than_the_second_model_saw() -> None:
    """Under a gear that forwards few samples to the second model, the third's reach rests on
    those few: its samples are the first model's that the second model's count stands for at
    the spec's thresholds, not the first model's whole count (four samples of ``b`` read as
    5,000, and the tuner sized ``c`` for a reach of 0.5 as if it were certain)."""
    meter = ReachMeter(("a", "b", "c"), (0.5, 0.8))
    meter.add("a", 10.0, seen=5000, below=2500)
    meter.add("b", 10.0, seen=2100, below=1050)
    reach = meter.reach(11.0)
    assert reach["b"] == (pytest.approx(0.5), 5000)
    assert reach["c"] == (pytest.approx(0.25), 4200)  # 2,100 of b: 4,200 of a at a share of 0.5
    # Under the spec's gear b sees what a's threshold forwards: c rests on all of a's.
    meter = ReachMeter(("a", "b", "c"), (0.5, 0.8))
    meter.add("a", 10.0, seen=5000, below=1234)
    meter.add("b", 10.0, seen=1234, below=617)
    assert meter.reach(11.0)["c"] == (pytest.approx(1234 / 5000 * 0.5), 5000)


def test_a_gear_that_sends_the_second_model_less_than_the_spec_leaves_the_third_unread() -> None:
    """Four samples of ``b`` where the spec's thresholds send it 2,500: a gear that forwards
    less is in force, ``b`` saw only the hardest samples, and its share below them would size
    ``c`` too large; ``c``'s reach is not read (the plan's share sizes it)."""
    meter = ReachMeter(("a", "b", "c"), (0.5, 0.8))
    meter.add("a", 10.0, seen=5000, below=2500)
    meter.add("b", 10.0, seen=4, below=4)
    reach = meter.reach(11.0)
    assert reach["b"] == (pytest.approx(0.5), 5000)
    assert "c" not in reach
