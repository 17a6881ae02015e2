"""What the client commands refuse before they send anything: an app name that is not one, and
a number that is not finite.

An app name with a ``/`` was sent as ``demo%2Fplans``, which the server decoded to another route
(``app get demo/plans`` printed a traceback); it is refused as the service's spec refuses it
(controlplane.spec, a DNS label), in one line with exit status 2. A NaN or an infinity given to
an option whose number is sent to the service was refused by the JSON encoder, which could not
say whose it was; it is refused by the option's argparse type, which names it. Each command runs
in process against the fake service of test_cli_client, which must get no request.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.cli import build_parser
from controlplane.cli.client import app_path
from controlplane.cli.output import UsageError
from controlplane.spec import AppSpec
from tests.component.test_api import spec
from tests.unit.test_cli_client import TOKEN, FakeService, cli

_NOT_AN_APP = (
    "is not a DNS label: 1 to 63 lower-case letters, digits and '-', starting and ending with a"
    " letter or digit"
)


@pytest.fixture(scope="module")
def service() -> Iterator[FakeService]:
    # One for the module: a fake's shutdown waits out its half-second poll.
    made = FakeService()
    yield made
    made.close()


@pytest.fixture
def fake(service: FakeService, monkeypatch: pytest.MonkeyPatch) -> FakeService:
    monkeypatch.setenv("HETEROPLANE_URL", service.url)
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    service.requests.clear()
    return service


def _refused(capsys: pytest.CaptureFixture[str], fake: FakeService, argv: list[str]) -> str:
    """The one line of a command refused with exit status 2 before any request."""
    status, out, err = cli(capsys, *argv)
    assert status == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert fake.requests == []
    return err.strip()


# --- app names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["app", "get", "demo/plans"], "app"),
        (["app", "get", "demo/budget"], "app"),
        (["app", "delete", "demo/plans", "--force"], "app"),
        (["app", "down", "demo/x", "--no-wait"], "app"),
        (["fleet", "--app", "demo/plans"], "fleet"),
        (["budget", "get", "--app", "demo/budget"], "budget"),
        (["budget", "set", "--app", "demo/x", "--usd-per-hr", "1", "--reason", "r"], "budget"),
        (["plans", "list", "--app", "demo/plans"], "plans"),
        (["plans", "preview", "--app", "demo/x", "--rate-qps", "10"], "plans"),
        (["plans", "apply", "--app", "demo/plans", "--id", "1"], "plans"),
        (["events", "--app", "demo/events"], "events"),
        (["rollout", "status", "--app", "demo/rollouts"], "rollout"),
        (["rollout", "abort", "--app", "demo/x"], "rollout"),
        (["rollout", "start", "--app", "demo/x", "--model", "m@2"], "rollout"),
        (["profile", "run", "--app", "demo/x"], "profile"),
    ],
)
def test_a_name_with_a_slash_is_refused_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], fake: FakeService, argv: list[str], command: str
) -> None:
    name = next(arg for arg in argv if "/" in arg)
    error = _refused(capsys, fake, argv)
    assert error == f"heteroplane {command}: app name {name!r} {_NOT_AN_APP}"


def test_loadgen_refuses_the_name_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str], fake: FakeService, tmp_path: Path
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s\n0\n")
    error = _refused(capsys, fake, ["loadgen", "--app", "demo/x", "--trace", str(trace)])
    assert error == f"heteroplane loadgen: app name 'demo/x' {_NOT_AN_APP}"


@pytest.mark.parametrize(
    "name", ["Demo", "-demo", "demo-", "de mo", "demo%2Fplans", "demo\n", "a" * 64, "démo"]
)
def test_every_name_the_spec_refuses_is_refused(
    capsys: pytest.CaptureFixture[str], fake: FakeService, name: str
) -> None:
    error = _refused(capsys, fake, ["app", "get", "--", name])
    assert error == f"heteroplane app: app name {name!r} {_NOT_AN_APP}"


def test_an_app_name_is_sent_as_it_was_given(
    capsys: pytest.CaptureFixture[str], fake: FakeService
) -> None:
    status, _, err = cli(
        capsys, "budget", "set", "--app", "demo", "--usd-per-hr", "2.5", "--reason", "r"
    )
    assert status == 0, err
    assert fake.requests[-1]["path"] == "/v1/apps/demo/budget"
    longest = "a" + "-" * 61 + "b"
    assert app_path(longest, "plans") == f"/v1/apps/{longest}/plans"


@given(st.text(alphabet="ab9-/Z%. \n", max_size=70))
def test_the_command_line_holds_a_name_to_the_specs_rule(name: str) -> None:
    """The client's copy of the rule agrees with the spec's, which registers the apps."""
    try:
        AppSpec.model_validate({**spec(), "name": name})
        registrable = True
    except pydantic.ValidationError as error:
        assert [e["loc"] for e in error.errors()] == [("name",)]
        registrable = False
    try:
        app_path(name)
        sendable = True
    except UsageError:
        sendable = False
    assert sendable == registrable


# --- numbers that are not finite -----------------------------------------------------------------

_ROLLOUT = ["rollout", "start", "--app", "demo", "--model", "m@2"]


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [
        (["budget", "set", "--app", "demo", "--reason", "r"], "--usd-per-hr", "nan"),
        (["budget", "set", "--app", "demo", "--reason", "r"], "--usd-per-hr", "inf"),
        (["budget", "set", "--app", "demo", "--reason", "r"], "--usd-per-hr", "1e400"),
        (["budget", "set", "--app", "demo", "--reason", "r"], "--usd-per-hr", "-inf"),
        (["plans", "preview", "--app", "demo"], "--rate-qps", "nan"),
        (["plans", "preview", "--app", "demo", "--rate-qps", "10"], "--cv2", "nan"),
        (["plans", "preview", "--app", "demo", "--rate-qps", "10"], "--duration", "inf"),
        (_ROLLOUT, "--min-agreement-share", "nan"),
        (_ROLLOUT, "--max-error-share", "inf"),
        (_ROLLOUT, "--min-accuracy", "NaN"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_naming_its_option(
    capsys: pytest.CaptureFixture[str],
    fake: FakeService,
    argv: list[str],
    option: str,
    value: str,
) -> None:
    # A value that starts with '-' is argparse's option unless joined to its own.
    given = [f"{option}={value}"] if value.startswith("-") else [option, value]
    error = _refused(capsys, fake, [*argv, *given])
    assert error.endswith(f"argument {option}: must be a finite number, got {value!r}")


def _client_commands(
    parser: argparse.ArgumentParser, prog: str = "heteroplane"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command (and action) whose parser takes ``--token``: those that call the service."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _client_commands(sub, f"{prog} {name}")
    if any("--token" in action.option_strings for action in parser._actions):
        yield prog, parser


def test_no_option_of_a_client_command_takes_a_bare_float() -> None:
    """A float option of a command that calls the service is finite by its type, so that a NaN
    or an infinity is refused naming the option (``float`` takes both)."""
    commands = list(_client_commands(build_parser()))
    assert len(commands) > 20
    bare = [
        f"{prog} {action.option_strings[0]}"
        for prog, parser in commands
        for action in parser._actions
        if action.type is float
    ]
    assert bare == []
