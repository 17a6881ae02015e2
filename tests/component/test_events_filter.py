"""``heteroplane events`` and ``GET /v1/apps/{app}/decisions`` by kind, and repeats collapsed: a
real SQLite store through the migrations, the real API on uvicorn on 127.0.0.1, the real command
line (the API served as the integration tests serve it, ``ApiServer``). The app's log is a
scaling decision, a burst of 120 gear switches, then another scaling decision: the case where the
newest 100 hid every scaling decision (issue 35, item 9)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest

from controlplane.cli import main
from controlplane.cli.operate import EventLine, collapse
from controlplane.clock import FAKE_EPOCH, FakeClock
from controlplane.db.store import Store
from controlplane.service.app import create_app
from controlplane.settings import Settings
from tests.component.test_api import spec, write_profiles
from tests.integration.conftest import ApiServer

APP = "toy"
BURST = 120


@dataclass
class Service:
    app: Any  # the FastAPI app (what ApiServer serves)
    settings: Settings  # its connection limits (what ApiServer serves it with)
    token: str
    store: Store
    url: str = ""


def _history(store: Store) -> None:
    at = FAKE_EPOCH + timedelta(seconds=10)
    store.record_decision(APP, "scale_up", "need 3 instances", at=at)
    for k in range(BURST):  # one every 100 ms
        at_k = at + timedelta(seconds=1 + 0.1 * k)
        store.record_decision(APP, "gear_switch", f"switch {k}", {"gear": k % 2}, at=at_k)
    store.record_decision(APP, "scale_down", "need 2 instances", at=at + timedelta(seconds=30))
    store.record_instance(
        APP,
        request_id="r1",
        instance_type="g4dn.xlarge",
        price_usd_per_hr=0.526,
        state="running",
        at=at + timedelta(seconds=31),
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One service for the module: the tests only read its history."""
    data_dir = tmp_path_factory.mktemp("events") / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    settings = Settings(data_dir=data_dir, provisioner="fake")
    store = Store.from_url(settings.database_url, FakeClock(), upgrade=True)
    token = store.create_token("operator", name="operator-token")
    service = Service(create_app(settings, store, FakeClock()), settings, token, store)
    try:
        with ApiServer(service) as url:  # type: ignore[arg-type]  # it serves service.app
            service.url = url
            headers = {"Authorization": f"Bearer {token}"}
            made = httpx.post(f"{url}/v1/apps", json=spec(APP), headers=headers)
            assert made.status_code == 201, made.text
            _history(store)
            yield service
    finally:
        store.close()


def decisions(service: Service, query: str) -> httpx.Response:
    return httpx.get(
        f"{service.url}/v1/apps/{APP}/decisions?{query}",
        headers={"Authorization": f"Bearer {service.token}"},
    )


def kinds(service: Service, query: str) -> list[str]:
    answer = decisions(service, query)
    assert answer.status_code == 200, answer.text
    return [d["kind"] for d in answer.json()]


def register(service: Service, app: str) -> None:
    """The app ``app`` registered through the API."""
    made = httpx.post(
        f"{service.url}/v1/apps",
        json=spec(app),
        headers={"Authorization": f"Bearer {service.token}"},
    )
    assert made.status_code == 201, made.text


def cli(capsys: pytest.CaptureFixture[str], service: Service, *argv: str) -> tuple[int, str, str]:
    """``heteroplane argv`` against ``service``, in-process: (exit status, stdout, stderr)."""
    try:
        status = main([*argv, "--url", service.url, "--token", service.token])
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_the_route_filters_by_kind_before_the_limit(service: Service) -> None:
    assert "scale_up" not in kinds(service, "limit=100")  # the burst hides it
    assert kinds(service, "kind=scale_up,scale_down&limit=100") == ["scale_up", "scale_down"]
    assert kinds(service, "kind=scale_up&kind=scale_down&limit=1") == ["scale_down"]
    assert kinds(service, "exclude_kind=gear_switch&limit=2") == ["scale_up", "scale_down"]
    assert kinds(service, "kind=scale_up,gear_switch&exclude_kind=gear_switch") == ["scale_up"]
    assert kinds(service, "kind=no_such_kind") == []
    # Empty names name nothing (the schema allows an empty parameter): no filter from them.
    assert kinds(service, "kind=scale_up,") == ["scale_up"]
    assert len(kinds(service, "kind=&limit=100")) == len(kinds(service, "limit=100"))


def test_events_collapses_a_burst_into_one_line(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, service, "events", "--app", APP, "--limit", "1000")
    assert status == 0
    lines = out.strip().splitlines()
    assert lines[0].split() == ["AT", "WHAT", "KIND", "TIMES", "DETAIL"]
    body = [line.split()[2] for line in lines[1:]]
    assert body == ["scale_up", "gear_switch", "scale_down", "new"]  # "new -> running"
    (burst,) = [line for line in lines if "gear_switch" in line]
    last = FAKE_EPOCH + timedelta(seconds=11 + 0.1 * (BURST - 1))  # the last switch's time
    assert f"{BURST}x over 11.9 s, last {last:%H:%M:%S}Z" in burst
    assert f"switch {BURST - 1}" in burst
    status, out, _ = cli(
        capsys, service, "events", "--app", APP, "--limit", "1000", "--no-collapse"
    )
    assert status == 0 and out.count("gear_switch") == BURST


def test_events_filters_by_kind(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = cli(capsys, service, "events", "--app", APP, "--kind", "scale_up,scale_down")
    assert status == 0
    assert [line.split()[2] for line in out.strip().splitlines()[1:]] == ["scale_up", "scale_down"]
    status, out, _ = cli(
        capsys, service, "events", "--app", APP, "--exclude-kind", "gear_switch",
        "--exclude-kind", "instance",
    )  # fmt: skip
    assert status == 0 and "gear_switch" not in out and "running" not in out
    assert "scale_up" in out and "scale_down" in out
    status, out, _ = cli(capsys, service, "events", "--app", APP, "--kind", "instance", "--json")
    answer = json.loads(out)
    assert answer["decisions"] == [] and [e["to_state"] for e in answer["events"]] == ["running"]
    # The limit counts after the filter: the newest scaling decision, not a gear switch.
    status, out, _ = cli(
        capsys, service, "events", "--app", APP, "--exclude-kind", "instance,gear_switch",
        "--limit", "1", "--json",
    )  # fmt: skip
    assert [d["kind"] for d in json.loads(out)["decisions"]] == ["scale_down"]


def test_an_empty_kind_is_a_usage_error(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = cli(capsys, service, "events", "--app", APP, "--kind", "scale_up,")
    assert status == 2 and out == ""
    assert err.strip() == "heteroplane events: --kind: a kind must not be empty, got 'scale_up,'"


def test_collapse_sums_the_stores_own_counts() -> None:
    first = EventLine("2026-01-01T00:00:00", "decision", "launch_failed", "a", 3,
                      "2026-01-01T00:00:20")  # fmt: skip
    second = EventLine("2026-01-01T00:00:30", "decision", "launch_failed", "b")
    between = EventLine("2026-01-01T00:00:10", "instance", "new -> running", "i-1")
    (one,) = collapse([first, second])
    assert (one.count, one.at, one.last_at, one.detail) == (
        4, "2026-01-01T00:00:00", "2026-01-01T00:00:30", "b"
    )  # fmt: skip
    # Only consecutive lines collapse: another kind between them keeps them apart.
    assert [line.count for line in collapse([first, between, second])] == [3, 1, 1]


def rollout_lines(
    service: Service,
    capsys: pytest.CaptureFixture[str],
    app: str,
    made: Sequence[tuple[int, str, dict[str, object]]],
) -> tuple[list[str], str]:
    """``app`` registered, the ``rollout`` decisions ``made`` (rollout id, what, more numbers)
    recorded a second apart, and ``events --kind rollout``'s lines (without the header) and
    output."""
    register(service, app)
    at = FAKE_EPOCH + timedelta(seconds=100)
    for seconds, (rollout, what, numbers) in enumerate(made):
        service.store.record_decision(
            app,
            "rollout",
            f"rollout {rollout}: {what}",
            {"rollout_id": rollout, **numbers},
            at=at + timedelta(seconds=seconds),
        )
    status, out, _ = cli(capsys, service, "events", "--app", app, "--kind", "rollout")
    assert status == 0
    return out.strip().splitlines()[1:], out


def test_two_rollouts_decisions_stay_two_lines(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollout's decisions name it (``numbers.rollout_id``): one rollout's run of decisions
    collapses, the next rollout's starts a line of its own."""
    made = ((1, "step 2", {}), (1, "promoted", {}), (2, "started", {}))
    lines, out = rollout_lines(service, capsys, "rolls", made)
    assert len(lines) == 2, out
    assert "2x over 1.0 s" in lines[0] and "rollout 1: promoted" in lines[0]
    assert "rollout 2: started" in lines[1] and "x over" not in lines[1]


def test_a_rollouts_moves_are_lines_of_their_own(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollout's decisions carry its state and step (``numbers.state``, ``step_index``): each
    move is a line of its own, and only a wait said again in one state at one step collapses
    (the whole rollout had read as one line, its last move's)."""
    moves = (
        ("profiling", 0, "waiting for the budget"),
        ("profiling", 0, "waiting for the budget"),
        ("starting", 0, "profiled"),
        ("canary", 0, "workers running"),
        ("canary", 1, "step 1 passed"),
        ("promoted", 1, "promoted"),
    )
    made = [(1, what, {"state": state, "step_index": step}) for state, step, what in moves]
    lines, out = rollout_lines(service, capsys, "moves", made)
    assert len(lines) == 5, out
    assert "2x over 1.0 s" in lines[0] and "waiting for the budget" in lines[0]
    moved = ("profiled", "workers running", "step 1 passed", "promoted")
    for line, what in zip(lines[1:], moved, strict=True):
        assert what in line and "x over" not in line, out


def test_a_rollouts_moves_in_one_state_and_step_are_lines_of_their_own(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rollout loop's moves share a state and step (``pending`` 0: profiled, granted,
    timed alone; ``promoted``: promoted, the handover done, planned again): each is a line,
    and only its waits (``numbers.wait``) in one state at one step fold. They had folded into
    one line showing the last (the promotion hidden behind the plan made after it)."""
    moves = (
        ("pending", True, "waiting for the budget: 0.3 USD/hr"),
        ("pending", True, "waiting for the budget: 0.2 USD/hr"),
        ("pending", False, "profiled before traffic"),
        ("pending", False, "step 1's extra instances granted"),
        ("pending", False, "timed alone before traffic"),
        ("running", False, "workers of the new version running"),
        ("promoted", False, "promoted: thresholds held"),
        ("promoted", False, "handover done"),
        ("promoted", False, "planned again with the new version"),
    )
    made = [
        (1, what, {"state": state, "step_index": 0, "wait": wait}) for state, wait, what in moves
    ]
    lines, out = rollout_lines(service, capsys, "steps", made)
    assert len(lines) == 8, out
    assert "2x over 1.0 s" in lines[0] and "0.2 USD/hr" in lines[0], out
    for line, (_, _, what) in zip(lines[1:], moves[2:], strict=True):
        assert what in line and "x over" not in line, out


def test_a_kind_no_event_has_names_the_kinds_the_log_has(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, service, "events", "--app", APP, "--kind", "scale_upp")
    assert status == 0
    assert out.strip() == (
        f"no events of kind scale_upp; the kinds in {APP}'s log: gear_switch, instance,"
        " scale_down, scale_up"
    )


def test_a_kind_no_event_has_names_only_the_kinds_there(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """An app whose log is empty says so, and one with decisions but no instance event does not
    list ``instance`` (it was always added)."""
    for name in ("quiet", "decided"):
        register(service, name)
    service.store.record_decision("decided", "scale_down", "need 1 instance", at=FAKE_EPOCH)
    status, out, _ = cli(capsys, service, "events", "--app", "quiet", "--kind", "scale_up")
    assert (status, out.strip()) == (0, "no events of kind scale_up; quiet's log is empty")
    status, out, _ = cli(capsys, service, "events", "--app", "decided", "--kind", "scale_up")
    assert (status, out.strip()) == (
        0,
        "no events of kind scale_up; the kinds in decided's log: scale_down",
    )


def test_a_kind_in_the_log_left_out_by_the_other_options_says_which(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--kind gear_switch --since LATER` and `--kind gear_switch --exclude-kind gear_switch`
    listed the log's kinds, gear_switch among them, as if the kind were misspelt."""
    later = (FAKE_EPOCH + timedelta(days=365)).isoformat()
    status, out, _ = cli(
        capsys, service, "events", "--app", APP, "--kind", "gear_switch", "--since", later
    )
    assert (status, out.strip()) == (0, f"no events of kind gear_switch (since {later})")
    status, out, _ = cli(
        capsys, service, "events", "--app", APP, "--kind", "gear_switch",
        "--exclude-kind", "gear_switch",
    )  # fmt: skip
    assert (status, out.strip()) == (
        0,
        "no events of kind gear_switch (--exclude-kind excludes them)",
    )
