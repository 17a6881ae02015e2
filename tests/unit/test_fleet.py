"""The fleet string contract: ``type=count,type=count``."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.cli import main
from estimator.errors import FleetError
from estimator.fleet import MAX_FLEET_INSTANCES, Fleet
from tests.unit.test_cli_capacity import write_profiles


def test_parse_keeps_order_and_counts() -> None:
    fleet = Fleet.parse("g4dn.xlarge=1, r5n.large=13")
    assert list(fleet.items()) == [("g4dn.xlarge", 1), ("r5n.large", 13)]
    assert fleet.total == 14
    assert fleet.expand()[:2] == ["g4dn.xlarge", "r5n.large"]
    assert str(fleet) == "g4dn.xlarge=1,r5n.large=13"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("g4dn.xlarge=-1", "must be >= 0"),
        ("g4dn.xlarge=two", "whole number"),
        ("g4dn.xlarge", "type=count"),
        ("", "type=count"),
        ("a.b=1,,c.d=2", "type=count"),
        ("a.b=1,a.b=2", "twice"),
        ("=3", "type=count"),
        ("bad name=1", "bad instance type name"),
    ],
)
def test_bad_fleets_are_refused(text: str, message: str) -> None:
    with pytest.raises(FleetError, match=message):
        Fleet.parse(text)


names = st.from_regex(r"[a-z][a-z0-9]{0,5}\.[a-z0-9]{1,8}", fullmatch=True)


def test_a_type_name_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(FleetError, match="bad instance type name"):
        Fleet.of({"g4dn.xlarge\n": 1})


@given(st.dictionaries(names, st.integers(0, 1000), min_size=1, max_size=6))
def test_round_trip_through_the_string_form(counts: dict[str, int]) -> None:
    fleet = Fleet.of(counts)
    assert Fleet.parse(str(fleet)) == fleet
    assert fleet.total == sum(counts.values())


def test_a_fleet_past_the_largest_is_refused_when_expanded() -> None:
    assert len(Fleet.of({"a.b": MAX_FLEET_INSTANCES - 1, "c.d": 1}).expand()) == MAX_FLEET_INSTANCES
    huge = Fleet.parse("emu.cpu.small=100000000000")  # once a MemoryError in expand
    assert huge.total == 100_000_000_000
    with pytest.raises(FleetError) as refused:
        huge.expand()
    message = str(refused.value)
    assert message == (
        "fleet emu.cpu.small=100000000000 has 100,000,000,000 instances, more than the 100,000"
        " a fleet may have"
    )


@pytest.mark.parametrize("command", ["simulate", "capacity"])
def test_the_commands_refuse_an_absurd_fleet_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    profiles = write_profiles(tmp_path / "p.csv")
    args = [command, "--profiles", str(profiles), "--model", "m", "--qos-ms", "80"]
    args += ["--fleet", "g4dn.xlarge=1,r5n.large=100000000000", "--batch-dist", "fixed:10"]
    args += ["--qps", "5", "--duration", "10"] if command == "simulate" else ["--queries", "100"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than the 100,000 a fleet may have" in err, err
