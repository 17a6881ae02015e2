"""The fleet string contract: ``type=count,type=count``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.errors import FleetError
from estimator.fleet import Fleet


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


@given(st.dictionaries(names, st.integers(0, 1000), min_size=1, max_size=6))
def test_round_trip_through_the_string_form(counts: dict[str, int]) -> None:
    fleet = Fleet.of(counts)
    assert Fleet.parse(str(fleet)) == fleet
    assert fleet.total == sum(counts.values())
