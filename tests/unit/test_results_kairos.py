"""The Kairos results experiment's pure helpers, and the prediction-noise seam it needs in
estimator.policies / estimator.capacity (noise_share, noise_seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.results.kairos import (
    below_one,
    binding_caps,
    empirical_pmf,
    finite_or_none,
    noise_cost,
    ratio,
    ratios,
    scaled_setting,
    span,
)
from estimator.capacity import Workload, fleet_capacity
from estimator.errors import SimulationError
from estimator.kairos_setting import KairosSetting
from estimator.policies import policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching.kairos import KairosPolicy

PRICES = {"g4dn.xlarge": 0.526, "c5n.2xlarge": 0.432, "r5n.large": 0.149, "t3.xlarge": 0.1664}


def test_scaled_setting_scales_budget_caps_and_qos() -> None:
    paper = KairosSetting()
    setting = scaled_setting(2.0, 0.8)
    assert setting.budget_usd_per_hr == pytest.approx(2 * paper.budget_usd_per_hr)
    assert dict(setting.max_counts) == {t: 2 * n for t, n in paper.max_counts.items()}
    assert dict(setting.qos_ms) == pytest.approx({m: 0.8 * q for m, q in paper.qos_ms.items()})
    assert dict(scaled_setting().max_counts) == dict(paper.max_counts)
    with pytest.raises(ValueError):
        scaled_setting(0.0)


@pytest.mark.parametrize("multiplier", [1.0, 2.0, 4.0])
def test_the_scaled_caps_never_bind_below_the_budget(multiplier: float) -> None:
    assert binding_caps(scaled_setting(multiplier), PRICES) == []


def test_binding_caps_names_a_cap_below_what_the_budget_buys() -> None:
    setting = KairosSetting(max_counts={"g4dn.xlarge": 2, "r5n.large": 17})
    assert binding_caps(setting, PRICES) == ["g4dn.xlarge"]  # $2.5 buys 4


def test_empirical_pmf_is_a_seeded_distribution_on_the_measured_sizes() -> None:
    spec = "gaussian:mean=300,sd=100,low=10,high=1000,step=10"
    sizes, p = empirical_pmf(spec, 20_000, 0)
    assert p.sum() == pytest.approx(1.0)
    assert np.all(p > 0) and np.all(np.diff(sizes) > 0)
    assert sizes.min() >= 10 and sizes.max() <= 1000 and np.all(sizes % 10 == 0)
    assert abs(float(sizes @ p) - 305) < 5  # rounding up to tens adds about 5 to the mean
    again = empirical_pmf(spec, 20_000, 0)
    assert np.array_equal(sizes, again[0]) and np.array_equal(p, again[1])


def test_ratio_span_and_json_helpers() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert span([1.234, 2.5, math.nan]) == "1.23x-2.50x"
    assert span([2.0, 2.001]) == "2.00x"
    assert span([math.nan]) == "n/a"
    assert span([90.4, 95.0], "{:.0f}%") == "90%-95%"
    assert span([-0.016, -0.009], "{:+.1%}") == "-1.6% to -0.9%"
    assert finite_or_none(math.nan) is None and finite_or_none(1.5) == 1.5


def test_ratios_of_one_model() -> None:
    result = {
        "budget_usd_per_hr": 2.5,
        "configs": {
            "chosen": {
                "upper_bound_qps": 150.0,
                "allowable_qps": {"kairos": 120.0, "fcfs": 30.0, "oracle": 150.0},
            },
            "homogeneous": {
                "upper_bound_qps": 60.0,
                "cost_usd_per_hr": 2.0,
                "allowable_qps": {"kairos": 50.0, "fcfs": 50.0, "oracle": 60.0},
            },
        },
    }
    r = ratios(result)
    assert r["chosen_over_homogeneous"] == pytest.approx(2.4)
    assert r["chosen_over_scaled_homogeneous"] == pytest.approx(120.0 / (50.0 * 1.25))
    assert r["bound_ratio"] == pytest.approx(2.5)
    assert r["kairos_over_fcfs"] == pytest.approx(4.0)
    assert r["kairos_share_of_oracle"] == pytest.approx(0.8)
    assert math.isnan(r["kairos_over_drs"])  # not run in this setting


def model_result(chosen_kairos: float, homogeneous_kairos: float) -> dict:
    return {
        "budget_usd_per_hr": 2.5,
        "configs": {
            "chosen": {
                "upper_bound_qps": 1.0,
                "allowable_qps": {"kairos": chosen_kairos, "fcfs": 1.0, "oracle": 1.0},
            },
            "homogeneous": {
                "upper_bound_qps": 1.0,
                "cost_usd_per_hr": 2.5,
                "allowable_qps": {"kairos": homogeneous_kairos, "fcfs": 1.0, "oracle": 1.0},
            },
        },
    }


def test_below_one_and_noise_cost() -> None:
    results = {
        "paper": {"a": model_result(100.0, 50.0), "b": model_result(40.0, 50.0)},
        "noise5": {"a": model_result(95.0, 50.0), "b": model_result(40.0, 50.0)},
    }
    assert below_one(results, "paper") == ["b"]
    assert noise_cost(results) == pytest.approx([-0.05, 0.0])


# -- the prediction-noise seam -----------------------------------------------------------------


def linear_profile(instance_type: str, per_item_ms: float) -> LatencyProfile:
    sizes = np.arange(10, 101, 10)
    return LatencyProfile(
        "m", instance_type, sizes, tuple(np.array([per_item_ms * b]) for b in sizes)
    )


PROFILES = {"gpu.x": linear_profile("gpu.x", 1.0), "cpu.x": linear_profile("cpu.x", 4.0)}
TOY_PRICES = {"gpu.x": 1.0, "cpu.x": 0.2}
QOS_MS = 150.0


def simulate_with(make, trace: Trace) -> np.ndarray:
    fleet = ("gpu.x", "cpu.x", "cpu.x", "cpu.x")
    stage = Stage("m", tuple(InstanceSpec(t) for t in fleet), PROFILES, make())
    result = simulate(
        trace, [stage], np.random.default_rng(0), prices_usd_per_hr=TOY_PRICES, qos_ms=QOS_MS
    )
    return result.response_ms


def toy_trace() -> Trace:
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 11, size=400) * 10
    return Trace(np.cumsum(rng.exponential(1 / 30.0, size=400)), sizes)


def test_policy_factory_wires_seeded_noise_into_kairos() -> None:
    make = policy_factory("kairos", PROFILES, ["gpu.x"], noise_share=0.05, noise_seed=3)
    policy = make()
    assert isinstance(policy, KairosPolicy) and policy.noise_share == 0.05
    plain = policy_factory("kairos", PROFILES, ["gpu.x"])()
    assert isinstance(plain, KairosPolicy) and plain.noise_share == 0.0
    trace = toy_trace()
    # Every policy of one factory draws the same noise: runs repeat exactly.
    assert np.array_equal(simulate_with(make, trace), simulate_with(make, trace))


def test_prediction_noise_changes_the_dispatch_but_not_the_service_times() -> None:
    trace = toy_trace()
    quiet = simulate_with(policy_factory("kairos", PROFILES, ["gpu.x"]), trace)
    noisy = simulate_with(
        policy_factory("kairos", PROFILES, ["gpu.x"], noise_share=0.5, noise_seed=3), trace
    )
    assert not np.array_equal(quiet, noisy)
    other_seed = simulate_with(
        policy_factory("kairos", PROFILES, ["gpu.x"], noise_share=0.5, noise_seed=4), trace
    )
    assert not np.array_equal(noisy, other_seed)


@pytest.mark.parametrize("policy", ["fcfs", "clockwork"])
def test_noise_is_refused_for_policies_that_do_not_predict_with_it(policy: str) -> None:
    with pytest.raises(SimulationError, match="kairos policy only"):
        policy_factory(policy, PROFILES, ["gpu.x"], noise_share=0.05)


def test_fleet_capacity_passes_the_noise_through_and_is_deterministic() -> None:
    rng = np.random.default_rng(2)
    workload = Workload.poisson(rng.integers(1, 11, size=300) * 10, rng)
    fleet = ["gpu.x", "cpu.x", "cpu.x"]

    def capacity(policy: str, noise_share: float, seed: int = 5) -> float:
        return fleet_capacity(
            PROFILES, fleet, policy, QOS_MS, workload, TOY_PRICES,
            noise_share=noise_share, noise_seed=seed,
        ).allowable_qps  # fmt: skip

    noisy = capacity("kairos", 0.05)
    assert noisy > 0 and noisy == capacity("kairos", 0.05)
    with pytest.raises(SimulationError, match="kairos policy only"):
        capacity("oracle", 0.05)
