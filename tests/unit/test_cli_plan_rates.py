"""The rates ``heteroplane plans preview`` prints: a plan for 0.00098 qps (``--rate-qps 0.001``,
the smallest the option takes) read "planned for 0.00 qps" while its JSON said 0.00098; rates
below 1 qps are printed to three significant figures (``controlplane.cli.output.rate_text``),
larger ones to two decimals as before. The command runs in process against the fake service of
test_cli_client, answering with the plan the API made at that rate (its numbers rounded).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from controlplane.cli.output import rate_text
from tests.unit.test_cli_client import ROUTES, FakeService, cli, fake

__all__ = ["fake"]  # the fixture, imported for this module's tests


def _plan(rate_qps: float, feasible: bool = True) -> dict[str, Any]:
    return {
        "id": 4,
        "app": "tiny",
        "status": "preview",
        "feasible": feasible,
        "cost_usd_per_hr": 0.149,
        "rate_qps": rate_qps,
        "max_feasible_qps": None if feasible else rate_qps / 2,
        "predicted_p99_ms": 21.5,
        "trace": {"count": 10, "source": "poisson at 0.001 qps, seed 0"},
        "stages": [
            {
                "name": "m",
                "fleet": {"r5n.large": 1},
                "batch_size": 1,
                "policy": "kairos",
                "predicted_p99_ms": 21.5,
                "throughput_qps": rate_qps,
                "cost_usd_per_hr": 0.149,
            }
        ],
        "steps": [],
    }


@pytest.mark.parametrize(
    ("rate_qps", "shown"),
    [(0.00098, "0.000980"), (0.0039, "0.00390"), (0.25, "0.250"), (28.84, "28.84")],
)
def test_plans_preview_prints_a_small_planned_rate_as_it_is(
    fake: FakeService,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    rate_qps: float,
    shown: str,
) -> None:
    monkeypatch.setitem(ROUTES, "/v1/apps/tiny/plans", (200, _plan(rate_qps), 0.0))
    status, out, err = cli(capsys, "plans", "preview", "--app", "tiny", "--rate-qps", "0.001")
    assert status == 0, err
    assert f"planned for {shown} qps" in out
    assert f", {shown} qps, $0.149/hr" in out  # the stage's throughput
    status, out, _ = cli(capsys, "plans", "preview", "--app", "tiny", "--rate-qps", "1", "--json")
    assert json.loads(out)["rate_qps"] == rate_qps


def test_an_infeasible_plans_small_servable_rate_is_printed_as_it_is(
    fake: FakeService, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ROUTES, "/v1/apps/tiny/plans", (200, _plan(0.004, feasible=False), 0.0))
    status, out, err = cli(capsys, "plans", "preview", "--app", "tiny", "--rate-qps", "0.004")
    assert status == 0, err
    assert "NOT feasible: at most 0.00200 qps can be served" in out
    assert "apply it with: heteroplane plans apply --app tiny --id 4" in out


def test_a_plan_without_stages_is_not_offered_to_apply(
    fake: FakeService, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing served within the budget (a cascade's budget below one instance per stage): the
    preview said "apply it with: heteroplane plans apply ..." for a plan the service refuses to
    apply (409, it would drain every instance)."""
    empty = {**_plan(0.0, feasible=False), "stages": [], "max_feasible_qps": 0.0}
    monkeypatch.setitem(ROUTES, "/v1/apps/tiny/plans", (200, empty, 0.0))
    status, out, err = cli(capsys, "plans", "preview", "--app", "tiny", "--rate-qps", "8")
    assert status == 0, err
    assert "plans apply" not in out, out
    assert "no stages" in out and "cannot be applied" in out, out


@pytest.mark.parametrize(
    ("rate_qps", "shown"),
    [
        (0.0, "0.00"),
        (0.000123456, "0.000123"),
        (0.9994, "0.999"),
        (0.99996, "1.000"),
        (1.0, "1.00"),
        (1234.5678, "1234.57"),
        (float("inf"), "inf"),
    ],
)
def test_a_rate_reads_with_three_significant_figures_below_one_qps(
    rate_qps: float, shown: str
) -> None:
    assert rate_text(rate_qps) == shown
