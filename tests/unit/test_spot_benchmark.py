"""benchmarks/spot.py's summary over saved rows (the replays themselves are the benchmark's)."""

from __future__ import annotations

from typing import Any

from benchmarks.spot import goal, summarise


def row(policy: str, seed: int, saving: float, within: float, **extra: Any) -> dict[str, Any]:
    return {
        "model": "rm2",
        "seed": seed,
        "interruptions_per_hr": 0.5,
        "policy": policy,
        "fleet": [{"g4dn.xlarge": 2}],
        "spot_fleet": [{"g4dn.xlarge": 1}],
        "cost_usd_per_hr": 2.0 * (1.0 - saving),
        "saving_vs_on_demand": saving,
        "slo_attainment": within,
        "predicted_slo_attainment": None if policy == "on-demand" else within,
        **({"admission": True} if "refused_share" in extra else {}),
        **extra,
    }


def test_the_summary_gives_medians_ranges_and_the_refused_share() -> None:
    rows = [
        row("on-demand", 1, 0.0, 0.995, refused_share=0.001),
        row("on-demand", 2, 0.0, 0.993, refused_share=0.003),
        row("spot-aware s=0.2", 1, 0.45, 0.992, refused_share=0.004),
        row("spot-aware s=0.2", 2, 0.41, 0.990, refused_share=0.008),
        row("spot-aware s=0.2", 3, 0.43, 0.996, refused_share=0.002),
        # Saved before the replay could refuse: no refused share, no admission flag.
        row("spothedge", 1, 0.30, 1.0),
    ]
    by_policy = {e["policy"]: e for e in summarise(rows)}
    assert list(by_policy) == ["on-demand", "spot-aware s=0.2", "spothedge"]
    spot = by_policy["spot-aware s=0.2"]
    assert spot["saving_vs_on_demand"] == {"median": 0.43, "min": 0.41, "max": 0.45}
    assert spot["refused_share"] == 0.004
    assert spot["seeds"] == 3
    assert by_policy["on-demand"]["refused_share"] == 0.002
    assert by_policy["on-demand"]["predicted_slo_attainment"] is None
    assert by_policy["spothedge"]["refused_share"] is None
    assert spot["admission"] == ["true"] and by_policy["spothedge"]["admission"] == ["false"]
    # 43 % cheaper, 99.2 % within the SLO, cheaper than SpotHedge-style (30 %): met.
    assert goal(summarise(rows), "rm2", 0.5) == "spot-aware s=0.2: met"
