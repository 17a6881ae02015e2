"""The dispatch-policy registry (matching/registry.py): a policy added through the registry
alone (its class, registered here, nothing else edited) is built by the estimator, runs in the
simulator and in ``replay``, may be named by a plan and by the command line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import build_parser
from controlplane.policies.replay import ReplayError, parse_plan, replay
from estimator.errors import SimulationError
from estimator.policies import policy_factory
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching import registry
from matching.errors import MatchingError
from matching.policy import (
    Dispatch,
    InstanceView,
    PolicySetting,
    QueuedQuery,
    StageContext,
    queries_per_call,
)
from tests.unit.test_replay import CPU, GPU, app_of, plan_document

NAME = "slowest-first"


class SlowestFirstPolicy:
    """The head of the queue to the *slowest* idle instance: the opposite of FCFS's choice, so
    that where it ran shows in which types answered."""

    name = NAME
    needs_base_type = False
    needs_threshold = False
    takes_noise = False
    in_plans = True
    matched_capacity = False
    batches = True

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], SlowestFirstPolicy]:
        return cls

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        idle = sorted(
            (inst for inst in instances if inst.is_idle(now_s)),
            key=lambda inst: (-inst.speed_rank, inst.index),
        )
        return [Dispatch(inst.index, (q.query_id,)) for inst, q in zip(idle, queue, strict=False)]

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """It predicts nothing."""


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy of the table, so that the throw-away policy leaves with the test.
    monkeypatch.setattr(registry, "POLICIES", dict(registry.POLICIES))
    registry.register(SlowestFirstPolicy)


def sparse_trace(n: int = 40) -> Trace:
    """One query a second: every instance is idle at every arrival."""
    return Trace(np.arange(n, dtype=np.float64), np.ones(n, dtype=np.int64))


def answering_types(result_instance: np.ndarray, types: tuple[str, ...]) -> set[str]:
    return {types[i] for i in result_instance.tolist()}


@pytest.mark.usefixtures("registered")
def test_the_estimator_builds_and_simulates_a_registered_policy(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    profiles = {t: app.profile("m", t) for t in (GPU, CPU)}
    instances = (InstanceSpec(GPU), InstanceSpec(CPU))
    answered = {}
    for name in ("fcfs", NAME):
        make = policy_factory(name, profiles, [GPU])
        stage = Stage("m", instances, profiles, make())
        prices = dict(app.prices_usd_per_hr)
        result = simulate(
            sparse_trace(), [stage], np.random.default_rng(0), prices_usd_per_hr=prices, qos_ms=50.0
        )
        answered[name] = answering_types(result.instance, result.instance_types[0])
    assert answered == {"fcfs": {GPU}, NAME: {CPU}}


@pytest.mark.usefixtures("registered")
def test_replay_runs_a_registered_policy_a_plan_names(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    plan = parse_plan(plan_document({GPU: 1, CPU: 1}, policy=NAME))
    assert plan.stages[0].policy == NAME
    result = replay(sparse_trace(), app, plan, np.random.default_rng(0), policy="static")
    assert result.simulation is not None
    types = result.simulation.instance_types[0]
    assert answering_types(result.simulation.instance, types) == {CPU}


@pytest.mark.usefixtures("registered")
def test_the_command_line_offers_a_registered_policy() -> None:
    command = "simulate --profiles p.json --model m --fleet g4dn.xlarge=1 --qos-ms 50 --policy"
    args = build_parser().parse_args([*command.split(), NAME])
    assert args.policy == NAME


def test_an_unregistered_name_is_refused_everywhere(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match="unknown policy 'slowest-first'"):
        policy_factory(NAME, {}, [])
    with pytest.raises(registry.UnknownPolicyError):
        registry.make(NAME, PolicySetting({}))
    plan = parse_plan(plan_document({GPU: 1, CPU: 1}, policy="fcfs"))
    with pytest.raises(ReplayError, match="'slowest-first': unknown"):
        replay(sparse_trace(), app_of(tmp_path), plan, np.random.default_rng(0), dispatch=NAME)


def test_what_a_policy_needs_is_checked_from_its_class() -> None:
    assert registry.names() == ("fcfs", "drs", "clockwork", "kairos")
    assert registry.plan_names() == ("fcfs", "kairos")
    with pytest.raises(registry.PolicySettingError, match="needs a base type"):
        registry.make("kairos", PolicySetting({}))
    with pytest.raises(registry.PolicySettingError, match="needs a batch-size threshold"):
        registry.make("drs", PolicySetting({}, base_types=("a",)))
    with pytest.raises(registry.PolicySettingError, match="noise"):
        registry.make("fcfs", PolicySetting({}, noise_share=0.1))


@pytest.mark.usefixtures("registered")
def test_a_second_class_cannot_take_a_registered_name() -> None:
    class Impostor(SlowestFirstPolicy):
        pass

    with pytest.raises(MatchingError, match="already registered"):
        registry.register(Impostor)


def test_a_registered_policy_says_what_a_call_carries_by_its_batches_alone() -> None:
    # queries_per_call is no method a policy must write: admission counts a policy's call at
    # its class's ``batches`` (the cap, or one query), within [1, cap] whatever a policy says.
    class AloneFirst(SlowestFirstPolicy):
        batches = False

    class Overstating(SlowestFirstPolicy):
        def queries_per_call(self, now_s: float, batch_cap: int) -> int:
            return 10 * batch_cap

    class Failing(AloneFirst):
        def queries_per_call(self, now_s: float, batch_cap: int) -> int:
            raise RuntimeError("a policy's bug")

    assert queries_per_call(SlowestFirstPolicy(), 0.0, 4) == 4
    assert queries_per_call(AloneFirst(), 0.0, 4) == 1
    assert queries_per_call(Overstating(), 0.0, 4) == 4
    assert queries_per_call(Failing(), 0.0, 4) == 1  # its class's batches, not an error
