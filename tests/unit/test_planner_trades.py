"""The planner's trades (``planning: {trades: true}``; docs/planner.md, "Trades after the cuts")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from controlplane.policies import planner as planner_module
from controlplane.policies.plan import DispatchName
from controlplane.policies.planner import plan_app
from controlplane.spec import PlanningSpec, ResolvedApp
from tests.unit.test_planner import app_for, gamma_trace, poisson_trace, resimulated_p99_ms


def with_trades(app: ResolvedApp) -> ResolvedApp:
    spec = app.spec.model_copy(update={"planning": PlanningSpec(trades=True)})
    return dataclasses.replace(app, spec=spec)


def test_trades_reach_a_cheaper_fleet_that_no_single_cut_reaches(tmp_path: Path) -> None:
    """The toy family at 15 ms and 60 qps: Algorithm 1 adds r5n.large (the most throughput per
    dollar) until the tail holds, and no single cut of Algorithm 2 leaves four r5n.large (one
    fewer misses; a move goes only to a cheaper type); one g4dn.xlarge, dearer than one r5n.large
    and cheaper than four, holds the tail."""
    app = app_for(tmp_path, 15.0, 1.5)
    trace = poisson_trace(60.0)
    plain = plan_app(app, trace)
    traded = plan_app(with_trades(app), trace)
    assert dict(plain.stages[0].fleet) == {"r5n.large": 4}  # the default is unchanged
    assert dict(traded.stages[0].fleet) == {"g4dn.xlarge": 1}
    assert traded.cost_usd_per_hr < plain.cost_usd_per_hr
    assert traded.feasible
    assert resimulated_p99_ms(app, traded, trace) <= 15.0
    assert any("trade 4 x r5n.large for one g4dn.xlarge" in step for step in traded.steps)
    assert not any("trade" in step for step in plain.steps)


@pytest.mark.parametrize(
    ("slo_ms", "rate_qps", "cv2"),
    [(15.0, 200.0, 1.0), (25.0, 60.0, 4.0), (40.0, 200.0, 4.0), (80.0, 500.0, 1.0)],
)
def test_trades_never_cost_more_and_keep_the_slo(
    tmp_path: Path, slo_ms: float, rate_qps: float, cv2: float
) -> None:
    """Every trade and every cut after it saves money and is kept only where the simulated tail
    holds: the plan with trades is never dearer, and meets the SLO on its trace."""
    app = app_for(tmp_path, slo_ms, 4.0)
    trace = poisson_trace(rate_qps) if cv2 == 1.0 else gamma_trace(rate_qps, cv2)
    plain = plan_app(app, trace)
    traded = plan_app(with_trades(app), trace)
    assert traded.cost_usd_per_hr <= plain.cost_usd_per_hr
    assert traded.feasible == plain.feasible
    assert traded.stages[0].predicted_p99_ms <= slo_ms
    assert resimulated_p99_ms(app, traded, trace) <= slo_ms
    assert traded.cost_usd_per_hr <= 4.0


class _Capacity(planner_module._Evaluator):
    """An evaluator whose tail is a function of the fleet alone (no simulation): the tests below
    pin what the trades search asks and decides."""

    tail: Callable[[Mapping[str, int]], float]
    asked: list[dict[str, int]]

    def _simulate(self, fleet: dict[str, int], batch: int) -> tuple[float, float, DispatchName]:
        self.asked.append(dict(fleet))
        return self.tail(fleet), 0.0, "fcfs"


def toy_stage(tmp_path: Path, prices: dict[str, float]) -> planner_module._StageInputs:
    app = app_for(tmp_path, 20.0, 10.0)
    setup = planner_module._setup(app, poisson_trace(60.0), [])
    return dataclasses.replace(setup.stages[0], prices_usd_per_hr=prices)


def capacity_evaluator(
    inputs: planner_module._StageInputs,
    capacity: Mapping[str, float],
    needed: float,
    needs: str | None = None,
) -> _Capacity:
    """The tail meets the SLO (20 ms) exactly when the fleet's summed capacity reaches
    ``needed`` (and it holds an instance of ``needs``, the only type fast enough, if given)."""
    evaluate = _Capacity(inputs, poisson_trace(60.0), 0)

    def tail(fleet: Mapping[str, int]) -> float:
        have = sum(capacity[t] * n for t, n in fleet.items())
        fast = needs is None or fleet.get(needs, 0) > 0
        return 10.0 if have >= needed and fast else 30.0

    evaluate.tail = tail
    evaluate.asked = []
    return evaluate


def test_a_sell_trade_takes_the_fewest_cheap_instances_that_hold(tmp_path: Path) -> None:
    """Two dear instances (1 USD/hr, capacity 10 each; the tail needs one of them) where one dear
    and four cheap ones (0.15 USD/hr, capacity 2 each: 18 >= 18) hold: Algorithm 2's single move
    (one dear to one cheap: 12) and removals fail; the trade sells one dear for the fewest cheap
    that hold, at most ceil(1 / 0.15) - 1 = 6, found by trying 6 and bisecting below it."""
    prices = {"g4dn.xlarge": 1.0, "r5n.large": 0.15, "t3.xlarge": 5.0}
    inputs = toy_stage(tmp_path, prices)
    capacity = {"g4dn.xlarge": 10.0, "r5n.large": 2.0, "t3.xlarge": 1.0}
    evaluate = capacity_evaluator(inputs, capacity, 18.0, needs="g4dn.xlarge")
    value = {t: capacity[t] / prices[t] for t in prices}
    steps: list[str] = []
    fleet, batch = planner_module._algorithm_2(inputs, evaluate, {"g4dn.xlarge": 2}, steps)
    assert fleet == {"g4dn.xlarge": 2}  # no single cut holds
    fleet, batch = planner_module._trades(inputs, evaluate, fleet, batch, value, steps)
    assert fleet == {"g4dn.xlarge": 1, "r5n.large": 4}
    assert batch == 1
    assert "trade one g4dn.xlarge for 4 more r5n.large" in " ".join(steps)
    assert {"g4dn.xlarge": 1, "r5n.large": 6} in evaluate.asked  # the most first
    assert {"g4dn.xlarge": 1, "r5n.large": 5} not in evaluate.asked  # then a bisection
    assert steps[-1].endswith("no trade between two types cuts cost within the SLO; done")


def test_a_buy_trade_sheds_the_fewest_cheap_instances_that_cost_more(tmp_path: Path) -> None:
    """Seven cheap instances (0.15 USD/hr) where one dear (0.5 USD/hr) replaces four of them
    (floor(0.5 / 0.15) + 1 = 4: 0.6 USD/hr > 0.5); Algorithm 2 afterwards removes a fifth where
    the capacity still holds."""
    prices = {"g4dn.xlarge": 0.5, "r5n.large": 0.15, "t3.xlarge": 5.0}
    inputs = toy_stage(tmp_path, prices)
    capacity = {"g4dn.xlarge": 10.0, "r5n.large": 2.0, "t3.xlarge": 1.0}
    evaluate = capacity_evaluator(inputs, capacity, 14.0)
    value = {t: capacity[t] / prices[t] for t in prices}
    steps: list[str] = []
    fleet, batch = planner_module._algorithm_2(inputs, evaluate, {"r5n.large": 7}, steps)
    assert fleet == {"r5n.large": 7}  # 14 exactly: no cut holds
    fleet, _ = planner_module._trades(inputs, evaluate, fleet, batch, value, steps)
    assert fleet == {"g4dn.xlarge": 1, "r5n.large": 2}  # 10 + 4 = 14, 0.8 USD/hr
    assert "trade 4 x r5n.large for one g4dn.xlarge" in " ".join(steps)


def test_trades_respect_the_caps(tmp_path: Path) -> None:
    """A cap on the dear type's count leaves the buy untried; on the cheap type's, the sell
    takes no more than the cap leaves room for."""
    prices = {"g4dn.xlarge": 0.5, "r5n.large": 0.15, "t3.xlarge": 5.0}
    inputs = dataclasses.replace(toy_stage(tmp_path, prices), max_counts={"g4dn.xlarge": 0})
    capacity = {"g4dn.xlarge": 10.0, "r5n.large": 2.0, "t3.xlarge": 1.0}
    evaluate = capacity_evaluator(inputs, capacity, 14.0)
    value = {t: capacity[t] / prices[t] for t in prices}
    fleet, _ = planner_module._trades(inputs, evaluate, {"r5n.large": 7}, 1, value, [])
    assert fleet == {"r5n.large": 7}
    assert not any(f.get("g4dn.xlarge") for f in evaluate.asked)

    prices = {"g4dn.xlarge": 1.0, "r5n.large": 0.15, "t3.xlarge": 5.0}
    inputs = dataclasses.replace(toy_stage(tmp_path, prices), max_counts={"r5n.large": 3})
    evaluate = capacity_evaluator(inputs, capacity, 18.0, needs="g4dn.xlarge")
    fleet, _ = planner_module._trades(inputs, evaluate, {"g4dn.xlarge": 2}, 1, value, [])
    assert fleet == {"g4dn.xlarge": 2}  # four r5n.large would hold; the cap allows three
    assert all(f.get("r5n.large", 0) <= 3 for f in evaluate.asked)
