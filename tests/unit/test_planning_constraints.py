"""The planning constraints (controlplane/spec.py, ``PlanningConstraints``): derived once from
the spec, and every planner and scaler holds to the same caps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from controlplane.policies.replay import parse_plan, replay
from controlplane.spec import ResolvedApp, load_spec, resolve_spec
from estimator.traces import step_profile
from tests.unit.test_replay import CPU, GPU, plan_document, trace_of, write_app


def capped_app(tmp_path: Path, gpu_cap: int, budget_usd_per_hr: float = 3.0) -> ResolvedApp:
    spec = write_app(tmp_path, budget_usd_per_hr)
    spec.write_text(spec.read_text() + f"max_counts:\n  {GPU}: {gpu_cap}\n")
    return resolve_spec(load_spec(spec))


def test_the_replayed_tuner_holds_to_the_specs_max_counts(tmp_path: Path) -> None:
    # 3 USD/hr buys 5 GPU instances and a jump to 1000 qps would want 10 or more; the spec lets
    # the app run 3. InferLine's tuner of a single stage (no ladder) once sized past the cap.
    app = capped_app(tmp_path, gpu_cap=3)
    trace = trace_of(step_profile(50.0, 1000.0, 20.0), 100.0)
    plan = parse_plan(plan_document({GPU: 2}))
    result = replay(trace, app, plan, np.random.default_rng(0), policy="tuner", boot_s={GPU: 5.0})
    assert max(w.fleet[GPU] for w in result.timeline) == 3
    assert any(d.action == "scale_up" for d in result.decisions)


def test_the_constraints_are_the_specs_limits(tmp_path: Path) -> None:
    app = capped_app(tmp_path, gpu_cap=0, budget_usd_per_hr=2.5)
    limits = app.constraints
    assert (limits.slo_ms, limits.percentile, limits.budget_usd_per_hr) == (50.0, 99.0, 2.5)
    assert limits.instance_types == (GPU, CPU) and limits.accuracy is None
    assert limits.caps([GPU, CPU]) == {GPU: 0}
    assert not limits.usable(GPU) and limits.usable(CPU) and not limits.usable("t3.nano")


def test_an_app_under_tighter_constraints_states_them_in_its_spec(tmp_path: Path) -> None:
    app = capped_app(tmp_path, gpu_cap=3)
    tighter = app.constraints.capped({GPU: 5, CPU: 2})
    capped = app.with_constraints(tighter)
    assert capped.spec.max_counts == {GPU: 3, CPU: 2}
    assert capped.constraints == tighter
    assert app.constraints.caps([GPU, CPU]) == {GPU: 3}  # the app itself is unchanged


def test_the_utilisation_autoscaler_holds_to_the_specs_max_counts(tmp_path: Path) -> None:
    app = capped_app(tmp_path, gpu_cap=3)
    trace = trace_of(step_profile(50.0, 1000.0, 20.0), 100.0)
    plan = parse_plan(plan_document({GPU: 2}))
    rng = np.random.default_rng(0)
    result = replay(trace, app, plan, rng, policy="utilization", boot_s={GPU: 5.0})
    assert max(w.fleet[GPU] for w in result.timeline) == 3
    capped = [d for d in result.decisions if d.action == "budget_capped"]
    assert capped and "cap of 3" in capped[0].reason
