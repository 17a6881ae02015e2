"""Lead on a rise: while the recent arrivals rise steadily the tuner sizes a laddered stage for
the load one boot ahead (:func:`controlplane.policies.tuner.rise_ahead`), so that what it
launches is serving when the load gets there; a step, a spike, noise and a fall buy no lead.
While they fall steadily it sizes for the load now, not the memory's highest
(:func:`controlplane.policies.tuner.fall_now`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from controlplane.policies.tuner import (
    RISE_MAX_GROWTH,
    TunerConfig,
    fall_now,
    initial_state,
    rise_ahead,
    tune,
)
from tests.unit.test_tuner_ladder import config, stage, ticks


def ramp(start_qps: float, slope_qps_per_s: float, end_s: float) -> np.ndarray:
    """Arrivals at the rate start + slope t, exactly (the n-th where the count reaches n)."""
    a, b = start_qps, slope_qps_per_s
    total = a * end_s + b * end_s**2 / 2.0
    n = np.arange(int(total))
    return (-a + np.sqrt(a * a + 2.0 * b * n)) / b


def poisson(rate_qps: float, start_s: float, end_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.uniform(start_s, end_s, rng.poisson(rate_qps * (end_s - start_s))))


def test_a_steady_rise_is_followed_one_boot_ahead() -> None:
    # 100 qps rising by 2 qps a second: 220 at 60 s, 280 thirty seconds later.
    growth, why = rise_ahead(ramp(100.0, 2.0, 60.0), 60.0, 60.0, 30.0, 1.0)
    assert growth == pytest.approx(280.0 / 220.0, rel=0.01)
    assert why.startswith("rising:") and "in 30 s" in why


def test_the_lead_is_capped() -> None:
    growth, _why = rise_ahead(ramp(1.0, 20.0, 60.0), 60.0, 60.0, 600.0, 1.0)
    assert growth == RISE_MAX_GROWTH


@pytest.mark.parametrize(
    "arrivals",
    [
        pytest.param(poisson(200.0, 0.0, 60.0, 1), id="flat"),
        # A step at 25 s, or a spike in the last ten seconds: jumps, not a line.
        pytest.param(np.concatenate([poisson(100, 0, 25, 2), poisson(300, 25, 60, 3)]), id="step"),
        pytest.param(np.concatenate([poisson(100, 0, 50, 4), poisson(400, 50, 60, 5)]), id="spike"),
        pytest.param(60.0 - ramp(100.0, 2.0, 60.0)[::-1], id="fall"),
        pytest.param(poisson(2.0, 0.0, 60.0, 6), id="too few arrivals"),
    ],
)
def test_no_steady_rise_no_lead(arrivals: np.ndarray) -> None:
    assert rise_ahead(np.sort(arrivals), 60.0, 60.0, 60.0, 1.0) == (1.0, "")


def test_a_bursty_stream_needs_a_larger_rise() -> None:
    # The same gentle rise read at CV^2 1 and at CV^2 8: the bursts could make it up.
    arrivals = ramp(200.0, 0.7, 60.0)
    assert rise_ahead(arrivals, 60.0, 60.0, 60.0, 1.0)[0] > 1.0
    assert rise_ahead(arrivals, 60.0, 60.0, 60.0, 8.0) == (1.0, "")


def _decisions(cfg: TunerConfig, arrivals: np.ndarray, until_s: float) -> list[tuple]:
    """Every decision of the tuner on :func:`stage` over ``arrivals``, as (at, action, type,
    reason)."""
    decisions, _state = ticks(stage(), cfg, arrivals, until_s)
    return [(d.at_s, d.action, d.instance_type, d.reason) for d in decisions]


def test_on_a_rise_the_tuner_launches_sooner_and_keeps_what_it_launched() -> None:
    # Planned at 32 qps on 4 cpu (40 qps), one gpu (100 qps, 60 s boot) at twice the load; the
    # load rises from 16 qps by 0.2 qps a second, past 32 qps at 80 s.
    arrivals = ramp(16.0, 0.2, 240.0)
    led = _decisions(config(), arrivals, 200.0)
    plain = _decisions(dataclasses.replace(config(), lead_on_rise=False), arrivals, 200.0)
    gpu_led = next(m for m in led if m[1:3] == ("scale_up", "gpu"))
    gpu_plain = next(m for m in plain if m[1:3] == ("scale_up", "gpu"))
    assert gpu_led[0] < gpu_plain[0]
    assert "rising:" in gpu_led[3] and "rising:" not in gpu_plain[3]
    # Nothing the lead bought is stopped while the load still rises, and nothing is launched
    # twice: one gpu, then the cpus stop once it serves.
    assert [m[2] for m in led if m[1] == "scale_up" and m[0] >= gpu_led[0]] == ["gpu"]
    assert all(m[2] == "cpu" for m in led if m[1] == "scale_down" and m[0] >= gpu_led[0])


def test_the_lead_waits_until_the_span_was_watched_whole() -> None:
    # The same rising minute, read by a tuner started at its beginning (watched whole) and by
    # one started half-way through (not yet: its first minute would read as a rise from nothing).
    arrivals = ramp(16.0, 0.5, 60.0)
    plan = stage()
    reasons = {}
    for started_s in (0.0, 30.0):
        state = initial_state([plan], now_s=started_s)
        decisions, _state = tune(arrivals, 60.0, state, [plan], config())
        reasons[started_s] = " ".join(d.reason for d in decisions)
    assert "rising:" in reasons[0.0]
    assert "rising:" not in reasons[30.0]


def falling_ramp(start_qps: float, slope_qps_per_s: float, end_s: float) -> np.ndarray:
    """Arrivals at the rate start - slope t over [0, end_s], exactly (a rising ramp reversed)."""
    end_qps = start_qps - slope_qps_per_s * end_s
    return np.sort(end_s - ramp(end_qps, slope_qps_per_s, end_s))


def test_a_steady_fall_is_read_as_the_load_now() -> None:
    # 220 qps falling by 1 qps a second: 215 at the first bin's middle (5 s), 160 at 60 s.
    factor, why = fall_now(falling_ramp(220.0, 1.0, 60.0), 60.0, 60.0, 1.0)
    assert factor == pytest.approx(160.0 / 215.0, rel=0.02)
    assert why.startswith("falling:")
    assert rise_ahead(falling_ramp(220.0, 1.0, 60.0), 60.0, 60.0, 30.0, 1.0) == (1.0, "")
    # A steeper fall is read as at most halved.
    assert fall_now(falling_ramp(220.0, 3.0, 60.0), 60.0, 60.0, 1.0)[0] == 1.0 / RISE_MAX_GROWTH


@pytest.mark.parametrize(
    "arrivals",
    [
        pytest.param(poisson(200.0, 0.0, 60.0, 8), id="flat"),
        pytest.param(np.concatenate([poisson(300, 0, 25, 9), poisson(100, 25, 60, 10)]), id="step"),
        pytest.param(ramp(100.0, 2.0, 60.0), id="rise"),
    ],
)
def test_no_steady_fall_no_change(arrivals: np.ndarray) -> None:
    assert fall_now(np.sort(arrivals), 60.0, 60.0, 1.0) == (1.0, "")


def test_on_a_fall_the_tuner_stops_sooner() -> None:
    # Planned at 32 qps on 4 cpu; the load falls from 40 qps by 0.1 qps a second (to 16 qps at
    # 240 s). Both first move to the mix of the load (a gpu, then back to cpu at 140 s); after
    # that the memory's highest rate lags the load now by up to a minute.
    arrivals = falling_ramp(40.0, 0.1, 240.0)
    led = _decisions(config(), arrivals, 239.0)
    plain = _decisions(dataclasses.replace(config(), follow_fall=False), arrivals, 239.0)

    def first_cpu_stop(made: list[tuple]) -> tuple:
        return next(m for m in made if m[1:3] == ("scale_down", "cpu") and m[0] > 140.0)

    assert first_cpu_stop(led)[0] < first_cpu_stop(plain)[0]
    assert "falling:" in first_cpu_stop(led)[3]
    assert all("falling:" not in m[3] for m in plain)


def test_a_fall_is_read_only_once_it_has_held_for_the_persistence() -> None:
    """One tick's line flickers on a steady load (a bin of 70 among 100-110): a scale-down on
    it was bought back at the next tick's "below plan" (a tester's four chases of 1-6 s). A fall
    is read as the load now only once the line has fallen at every tick for
    ``fall_persist_s``; a tick whose line does not fall starts the count again."""
    plan, cfg = stage(), config()
    arrivals = falling_ramp(40.0, 0.1, 240.0)
    state = dataclasses.replace(initial_state([plan], now_s=0.0), last_change_s=0.0)
    seen = arrivals[arrivals <= 200.0]
    first, after = tune(seen, 200.0, state, [plan], cfg)
    assert after.falling_since_s == 200.0
    assert all("falling:" not in d.reason for d in first)
    # Held for the persistence: read (the same tick with the fall seen since 190 s).
    held = dataclasses.replace(after, falling_since_s=200.0 - cfg.fall_persist_s)
    read, kept = tune(seen, 200.0, held, [plan], cfg)
    assert kept.falling_since_s == 200.0 - cfg.fall_persist_s
    assert any("falling:" in d.reason for d in read)
    # A tick whose line does not fall (a steady load) forgets the fall.
    flat = poisson(30.0, 0.0, 200.0, seed=3)
    _, reset = tune(flat, 200.0, held, [plan], cfg)
    assert reset.falling_since_s is None


def test_load_that_starts_after_an_idle_gap_is_no_steady_rise() -> None:
    """Nothing for the first 10 s of the span, then a load rising from 4 to 20 qps: the line
    through the bins rises, but its first bin is empty: a start, not a rise to lead."""
    started = 10.5 + ramp(4.0, 0.3, 49.5)
    assert rise_ahead(started, 60.0, 60.0, 30.0, 1.0) == (1.0, "")
    # The same rise without the gap is led.
    assert rise_ahead(ramp(4.0, 0.3, 60.0), 60.0, 60.0, 30.0, 1.0)[0] > 1.0
