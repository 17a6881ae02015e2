"""The rollout command's own argument types and refusals (controlplane.cli.parsers)."""

from __future__ import annotations

import argparse

import pytest

from controlplane.cli import main
from controlplane.cli.parsers import duration_s, percent_steps


def test_durations_and_steps() -> None:
    assert [duration_s(t) for t in ("90", "90s", "2m", "1.5h")] == [90.0, 90.0, 120.0, 5400.0]
    assert percent_steps("5,25,50,100") == [5.0, 25.0, 50.0, 100.0]
    for bad in ("0", "-1m", "2x", "m"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration_s(bad)
    for bad in ("5,50", "50,25,100", "5,x,100", "0,100"):
        with pytest.raises(argparse.ArgumentTypeError):
            percent_steps(bad)
    # Refused as the service would, which keeps a share to six places (it said "got 0,1").
    assert percent_steps("0.0001,99.9999,100") == [0.0001, 99.9999, 100.0]
    for bad in ("1e-9,100", "0.00004,100", "50,50.00001,100"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"kept to 0\.0001 %"):
            percent_steps(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "50,25,100"], "steps must increase"),
        (["--interval", "soon"], "not a duration"),
        (["--interval", "2m", "--interval-s", "60"], "not allowed with argument"),
        (["--min-queries", "0"], "--min-queries"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["rollout", "start", "--app", "a", "--model", "m@2", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_a_pending_rollout_says_what_it_does_before_traffic() -> None:
    from controlplane.cli.rollout import _line

    document = {
        "id": 3, "app": "wine", "model": "clf", "artifact": "wine", "from_version": 1,
        "to_version": 2, "state": "pending", "phase": "waiting_for_budget", "step_share": 0.05,
        "steps": [0.05, 1.0], "reason": "waiting for the budget: step 1 needs ...",
    }  # fmt: skip
    line = _line(document)
    assert line.startswith("rollout 3 of wine: clf wine@1 -> @2, pending (waiting for budget),")
    assert _line({**document, "state": "running", "phase": None}).count("running,") == 1
