"""The scaling-policy registry (controlplane/policies/scaling.py): a policy added through the
registry alone is offered by ``heteroplane replay`` and replayed; what a policy does is read
from its entry."""

from __future__ import annotations

import typing
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import build_parser
from controlplane.cli.output import UsageError
from controlplane.cli.replay import scaling_policy
from controlplane.policies import scaling
from controlplane.policies.plan import StagePlan
from controlplane.policies.replay import (
    FleetTimeline,
    ReplayError,
    TimelineOptions,
    parse_plan,
    replay,
)
from controlplane.spec import AppSpec, ResolvedApp
from estimator.simulator import InstanceSpec
from estimator.traces import Trace
from tests.unit.test_dispatch_registry import sparse_trace
from tests.unit.test_replay import CPU, GPU, app_of, plan_document


def doubled_timeline(
    trace: Trace, app: ResolvedApp, stage: StagePlan, options: TimelineOptions
) -> FleetTimeline:
    """Twice the plan's fleet, from start to end."""
    return FleetTimeline(
        tuple(InstanceSpec(t) for t, n in stage.fleet.items() for _ in range(2 * n))
    )


@pytest.fixture
def doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaling, "POLICIES", dict(scaling.POLICIES))
    scaling.register(scaling.ScalingEntry("doubled", doubled_timeline))


@pytest.mark.usefixtures("doubled")
def test_replay_runs_a_registered_scaling_policy(tmp_path: Path) -> None:
    plan = parse_plan(plan_document({GPU: 1, CPU: 1}))
    rng = np.random.default_rng(0)
    result = replay(sparse_trace(), app_of(tmp_path), plan, rng, policy="doubled")
    assert result.policy == "doubled"
    assert [s.instance_type for s in result.fleet_timeline.instances] == [GPU, GPU, CPU, CPU]
    command = ["replay", "--spec", "a.yaml", "--trace", "t.csv", "--policy", "doubled"]
    assert build_parser().parse_args(command).policy == "doubled"
    assert scaling_policy("on", "doubled") == ("doubled", "doubled")


def test_what_a_scaling_policy_does_is_read_from_its_entry(tmp_path: Path) -> None:
    assert scaling.replay_names() == ("tuner", "static", "peak", "mean", "utilization")
    assert scaling_policy("on", "peak") == ("static", "peak")
    assert scaling_policy("off", None) == ("static", "static")
    with pytest.raises(UsageError, match="--tuner off"):
        scaling_policy("off", "utilization")
    cascade = parse_plan(plan_document({GPU: 1}))
    with pytest.raises(ReplayError, match="unknown scaling policy 'nope'"):
        replay(sparse_trace(), app_of(tmp_path), cascade, np.random.default_rng(0), policy="nope")


def test_the_specs_scaling_values_are_the_live_policies() -> None:
    # The spec sits below the policies (it cannot import the registry): its values are pinned.
    field = AppSpec.model_fields["scaling"]
    assert set(typing.get_args(field.annotation)) == set(scaling.live_names())
    assert field.default == scaling.DEFAULT_LIVE
    assert scaling.live_owner(None) == scaling.live_owner("inferline") == "tuner"
    assert scaling.live_owner("infaas") == "infaas"
    with pytest.raises(scaling.UnknownScalingPolicyError):
        scaling.live_owner("karpenter")
