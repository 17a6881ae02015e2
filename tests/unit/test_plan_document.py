"""The typed plan document (controlplane/policies/plan.py): it reads what the planner writes,
sums the fleet over stages, names the field of a malformed document, and keeps a plan with a
malformed envelope readable while saying what is wrong with it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.policies.plan import PlanDocument, PlanError, StagePlan
from estimator.fleet import Fleet


def document(**extra: Any) -> dict[str, Any]:
    return {
        "feasible": True,
        "cost_usd_per_hr": 1.5,
        "stages": [
            {"name": "small", "fleet": {"a": 2}, "batch_size": 1, "scale_factor": 1.0},
            {"name": "large", "fleet": {"a": 1, "b": 1}, "batch_size": 4, "scale_factor": 0.2},
        ],
        "planned_rate_qps": 20.0,
        "steps": ["one"],
        **extra,
    }


def stage(**fields: Any) -> dict[str, Any]:
    return {"name": "m", "fleet": {"a": 1}, "batch_size": 1, **fields}


def test_the_fleet_is_summed_over_the_stages() -> None:
    plan = PlanDocument.parse(document())
    assert plan.fleet == {"a": 3, "b": 1}
    large = plan.stage("large")
    assert large is not None and large.batch_size == 4 and large.scale_factor == 0.2
    assert plan.stage("other") is None
    assert PlanDocument.parse(document(stages=[])).fleet == {}


def test_a_document_round_trips() -> None:
    raw = document(
        seed=3,
        trace={"source": "poisson", "request": {"rate_qps": 5.0}},
        envelope={"windows_s": [1.0, 2.0], "rate_qps": [30.0, 25.0]},
        gear_plan={"gears": []},
        max_feasible_qps=12.0,
    )
    plan = PlanDocument.parse(raw)
    again = PlanDocument.parse(plan.to_document())
    assert again == plan
    assert again.envelope_windows_s == (1.0, 2.0) and again.seed == 3
    assert again.trace is not None and again.trace["request"] == {"rate_qps": 5.0}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([], ""),
        ({"cost_usd_per_hr": 1.0, "stages": []}, "feasible"),
        ({"feasible": "yes", "cost_usd_per_hr": 1.0, "stages": []}, "feasible"),
        ({"feasible": True, "stages": []}, "cost_usd_per_hr"),
        ({"feasible": True, "cost_usd_per_hr": float("nan"), "stages": []}, "cost_usd_per_hr"),
        ({"feasible": True, "cost_usd_per_hr": 1.0, "stages": {}}, "stages"),
        (document(stages=[{"fleet": {"a": 1}, "batch_size": 1}]), "stages[0].name"),
        (document(stages=[{"name": "m", "fleet": [1], "batch_size": 1}]), "stages[0].fleet"),
        (
            document(stages=[{"name": "m", "fleet": {"a": -1}, "batch_size": 1}]),
            "stages[0].fleet[a]",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "batch_size": 0}]),
            "stages[0].batch_size",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "batch_size": 1, "policy": "drs"}]),
            "stages[0].policy",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "batch_size": 10**9}]),
            "stages[0].batch_size",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "scale_factor": -1}]),
            "stages[0].scale_factor",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "scale_factor": 5}]),
            "stages[0].scale_factor",
        ),
        (
            document(stages=[{"name": "m", "fleet": {"a": 1}, "throughput_qps": -2.0}]),
            "stages[0].throughput_qps",
        ),
        (document(seed=-1), "seed"),
        (document(rate_qps="20"), "rate_qps"),
        (document(rate_qps=-1.0, planned_rate_qps=None), "rate_qps"),
        (document(rate_qps=21.0), "rate_qps"),  # disagrees with planned_rate_qps 20
        (document(planned_rate_qps=float("inf")), "planned_rate_qps"),
        (document(predicted_p99_ms=float("nan")), "predicted_p99_ms"),
        (document(predicted_p99_ms=-3.0), "predicted_p99_ms"),
        (document(predicted_p99_ms=True), "predicted_p99_ms"),
    ],
)
def test_a_malformed_document_names_its_field(raw: object, field: str) -> None:
    with pytest.raises(PlanError) as caught:
        PlanDocument.parse(raw)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("envelope", "problem"),
    [
        ([1, 2], "expected an object"),
        ({"windows_s": "1", "rate_qps": [1.0]}, "windows_s is not a list"),
        ({"windows_s": [1.0, 2.0], "rate_qps": [1.0]}, "2 windows and 1 rates"),
        ({"windows_s": [2.0, 1.0], "rate_qps": [1.0, 1.0]}, "not increasing"),
        ({"windows_s": [1.0], "rate_qps": [-1.0]}, "not a finite number > 0"),
    ],
)
def test_a_malformed_envelope_leaves_the_plan_readable(envelope: object, problem: str) -> None:
    plan = PlanDocument.parse(document(envelope=envelope))
    assert plan.envelope_windows_s == () and plan.envelope_problem is not None
    assert problem in plan.envelope_problem
    assert plan.fleet == {"a": 3, "b": 1}


@given(
    st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 50), max_size=3),
        max_size=4,
    )
)
def test_the_fleet_is_the_sum_of_the_stage_fleets(fleets: list[dict[str, int]]) -> None:
    stages = tuple(StagePlan(f"m{i}", Fleet.of(f), 1) for i, f in enumerate(fleets))
    plan = PlanDocument(feasible=True, cost_usd_per_hr=0.0, stages=stages)
    for name in ("a", "b", "c"):
        assert plan.fleet.get(name, 0) == sum(f.get(name, 0) for f in fleets)
    assert PlanDocument.parse(plan.to_document()).fleet == plan.fleet


def test_the_rate_and_the_end_to_end_prediction_are_top_level() -> None:
    plan = PlanDocument.parse(document(rate_qps=20.0, predicted_p99_ms=41.5))
    assert plan.rate_qps == plan.planned_rate_qps == 20.0 and plan.predicted_p99_ms == 41.5
    written = plan.to_document()
    assert written["rate_qps"] == written["planned_rate_qps"] == 20.0
    assert written["predicted_p99_ms"] == 41.5
    assert PlanDocument.parse(written) == plan
    # A document with the new name only reads the same.
    assert PlanDocument.parse(document(rate_qps=20.0, planned_rate_qps=None)).rate_qps == 20.0


def test_an_older_document_reads_without_the_new_fields() -> None:
    plan = PlanDocument.parse(document())  # planned_rate_qps only, no prediction
    assert plan.rate_qps == 20.0 and plan.predicted_p99_ms is None
    written = plan.to_document()
    assert written["rate_qps"] == 20.0 and written["predicted_p99_ms"] is None
    assert PlanDocument.parse(written) == plan
    bare = {"feasible": False, "cost_usd_per_hr": 0.0, "stages": []}
    assert PlanDocument.parse(bare).rate_qps == 0.0


def test_a_plan_without_stages_predicts_nothing() -> None:
    plan = PlanDocument(feasible=False, cost_usd_per_hr=0.0, stages=(), max_feasible_qps=0.0)
    assert plan.predicted_p99_ms is None
    assert PlanDocument.parse(plan.to_document()).predicted_p99_ms is None
