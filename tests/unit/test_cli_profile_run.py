"""``heteroplane profile run``: the request it sends the service and the summary it prints."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controlplane.cli import main, profile_run
from controlplane.cli.client import ApiClientError

RESULT = {
    "app": "digits",
    "models": ["small"],
    "instance_types": ["emu.cpu.small"],
    "batch_sizes": [1, 4],
    "samples": 5,
    "cost_usd_per_hr": 0.05,
    "elapsed_s": 12.0,
    "measured_at": "2024-01-01T00:00:00+00:00",
    "profiles": [
        {
            "model": "small",
            "instance_type": "emu.cpu.small",
            "batch_sizes": [1, 4],
            "mean_ms": [2.5, 7.0],
            "p99_ms": [3.0, 8.0],
        }
    ],
}


CHECKED = {
    "app": "digits",
    "checked": True,
    "models": ["small"],
    "instance_types": ["emu.cpu.small", "emu.cpu.large"],
    "cost_usd_per_hr": 0.15,
    "calls_per_worker": 50,
    "local_workers": True,
}


class FakeClient:
    def __init__(self, args: Any) -> None:
        self.timeout = args.timeout
        self.sent: list[tuple[str, Any]] = []

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def post(self, path: str, body: Any) -> Any:
        self.sent.append((path, body))
        if path.endswith("?check=true"):
            if body.get("samples") == 999:
                raise ApiClientError("422 invalid_value: samples: refused")
            return {**CHECKED, "instance_types": body.get("types", CHECKED["instance_types"])}
        return RESULT


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[FakeClient]:
    """The clients the command made, each a FakeClient."""
    found: list[FakeClient] = []

    def client_from(args: Any) -> FakeClient:
        found.append(FakeClient(args))
        return found[-1]

    monkeypatch.setattr(profile_run, "client_from", client_from)
    return found


def test_profile_run_posts_the_request_and_prints_a_summary(
    made: list[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "run", "--app", "digits", "--types", "emu.cpu.small"]
    assert main([*argv, "--batch-sizes", "4,1", "--samples", "5"]) == 0
    (client,) = made
    assert client.timeout == profile_run.DEFAULT_RUN_TIMEOUT_S
    body = {"types": ["emu.cpu.small"], "batch_sizes": [1, 4], "samples": 5}
    # The service checks the request before the run (and before the line that says it takes
    # minutes), then runs it.
    assert client.sent == [
        ("/v1/apps/digits/profiles?check=true", body),
        ("/v1/apps/digits/profiles", body),
    ]
    captured = capsys.readouterr()
    assert "profiles of digits stored" in captured.out and "7" in captured.out
    assert "profiling digits (small) on emu.cpu.small" in captured.err
    assert captured.err.splitlines()[0].endswith(
        " (0.15 USD/hr), processes on the service's machine that start in seconds, and times"
        " 50 calls through each"
    )
    assert "minutes" not in captured.err
    assert main(["profile", "run", "--app", "digits", "--json", "--timeout", "9"]) == 0
    assert json.loads(capsys.readouterr().out) == RESULT
    assert made[-1].timeout == 9
    assert made[-1].sent == [
        ("/v1/apps/digits/profiles?check=true", {}),
        ("/v1/apps/digits/profiles", {}),
    ]


def test_a_request_the_service_refuses_says_so_before_any_progress_line(
    made: list[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["profile", "run", "--app", "digits", "--samples", "999"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "refused" in err and "profiling" not in err
    assert [path for path, _ in made[-1].sent] == ["/v1/apps/digits/profiles?check=true"]


@pytest.mark.parametrize(
    ("checked", "said"),
    [
        (
            {"calls_per_worker": 1250, "local_workers": False},
            ", instances that take minutes to boot, and times 1,250 calls through each",
        ),
        ({}, "; this can take minutes"),  # a service whose check says neither
    ],
)
def test_the_line_before_a_run_says_how_its_workers_start(
    checked: dict[str, Any], said: str
) -> None:
    """It said "this takes minutes" of a run of a second or two on the local provisioner."""
    base = {k: v for k, v in CHECKED.items() if k not in ("calls_per_worker", "local_workers")}
    line = profile_run._progress_line("digits", {**base, **checked})
    assert line == (
        "profiling digits (small) on emu.cpu.small, emu.cpu.large: the service starts one"
        f" worker per type (0.15 USD/hr){said}"
    )


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--batch-sizes", "1,x", "not a whole number"), ("--samples", "0", "--samples must be")],
)
def test_bad_options_are_one_line(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["profile", "run", "--app", "digits", option, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_profile_help_describes_run_beside_measure_and_show(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["profile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0
    description = out.split("positional arguments")[0]
    assert "have the service measure an app's registered models" in description
