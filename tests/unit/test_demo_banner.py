"""The plan line of ``heteroplane demo``'s banner (controlplane/cli/demo.py): each stage's fleet
named by its stage where the plan has several."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from controlplane.cli.demo import _plan_summary
from controlplane.db.store import PlanRecord


def record(stages: list[dict[str, Any]]) -> PlanRecord:
    document = {
        "feasible": True,
        "cost_usd_per_hr": 0.05 * len(stages),
        "stages": stages,
        "planned_rate_qps": 11.8,
        "predicted_p99_ms": 229.7,
        "steps": [],
    }
    at = datetime(2026, 12, 7, tzinfo=UTC)
    return PlanRecord(1, "demo", 1, "applied", document, 1, at, at)


def stage(name: str, fleet: dict[str, int]) -> dict[str, Any]:
    return {"name": name, "fleet": fleet, "batch_size": 1}


def test_a_cascades_fleets_are_named_by_their_stages() -> None:
    small = {"emu.cpu.small": 1}
    plan = record([stage("tiny", small), stage("medium", small), stage("large", small)])
    assert _plan_summary(plan, 0.5) == (
        "plan 1 applied: tiny: emu.cpu.small=1; medium: emu.cpu.small=1;"
        " large: emu.cpu.small=1, $0.15/hr, predicted end-to-end p99 230 ms at 12 qps"
    )


def test_a_single_stage_fleet_is_not_named() -> None:
    plan = record([stage("wine", {"emu.cpu.small": 2, "emu.cpu.large": 1})])
    assert _plan_summary(plan, 0.5).startswith(
        "plan 1 applied: emu.cpu.large=1,emu.cpu.small=2, $0.05/hr"
    )
