"""Spot in the catalog (a spot price and an interruption rate per type) and in the app spec (the
``spot:`` block): the shipped values, the checks, and the one-line errors for bad input."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from controlplane.spec import SpecError, resolve_spec, validate_spec
from estimator.catalog import InstanceType, default_catalog, read_catalog_file, write_catalog_file
from estimator.errors import CatalogError
from tests.conftest import KAIROS_CSV, needs_shared


def test_every_ec2_type_has_a_spot_price_below_on_demand_and_a_rate() -> None:
    for t in default_catalog().values():
        if t.family == "local":
            assert not t.has_spot
            continue
        assert t.spot_price_usd_per_hr is not None
        assert 0 < t.spot_price_usd_per_hr < t.price_usd_per_hr
        assert t.interruptions_per_hr > 0


def test_spot_columns_follow_the_rule_docs_catalog_states() -> None:
    # docs/catalog.md: spot = round(on-demand x (1 - savings), 4), rate = -ln(1 - p_month) / 730.
    g4dn = default_catalog()["g4dn.xlarge"]
    assert g4dn.spot_price_usd_per_hr == round(0.526 * 0.4, 4)
    assert math.isclose(g4dn.interruptions_per_hr, -math.log(1 - 0.075) / 730, rel_tol=5e-3)
    assert default_catalog().spot_price_usd_per_hr("emu.cpu.small") == 0.015


def test_a_spot_price_above_on_demand_is_one_line_naming_the_field() -> None:
    with pytest.raises(CatalogError) as caught:
        InstanceType("x.large", 0.1, spot_price_usd_per_hr=0.2)
    assert "spot_price_usd_per_hr" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(CatalogError, match="interruptions_per_hr: must be >= 0"):
        InstanceType("x.large", 0.1, interruptions_per_hr=-1.0)


def test_spot_columns_round_trip_through_csv_and_json(tmp_path: Path) -> None:
    types = [
        InstanceType("a.large", 0.2, spot_price_usd_per_hr=0.07, interruptions_per_hr=0.01),
        InstanceType("b.large", 0.3),
    ]
    for suffix in (".csv", ".json"):
        path = tmp_path / f"types{suffix}"
        write_catalog_file(types, path)
        assert read_catalog_file(path) == types


def test_a_bad_spot_cell_in_a_file_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "prices.csv"
    path.write_text("instance_type,price_usd_per_hr,spot_price_usd_per_hr\na.large,0.1,cheap\n")
    with pytest.raises(CatalogError, match=r"row 1 .*spot_price_usd_per_hr: not a number"):
        read_catalog_file(path)


SPEC: dict[str, Any] = {
    "name": "recs",
    "models": [{"name": "rm2", "profiles": str(KAIROS_CSV)}],
    "slo": {"latency_ms": 350},
    "budget_usd_per_hr": 10,
    "instance_types": ["g4dn.xlarge", "r5n.large"],
}


def test_the_spot_block_has_defaults_and_is_off_when_left_out() -> None:
    assert not validate_spec(SPEC).spot_enabled
    spot = validate_spec({**SPEC, "spot": {"enabled": True}}).spot
    assert spot is not None and (spot.max_share, spot.survive_share) == (1.0, 0.5)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"enabled": True, "max_share": 1.5}, "spot.max_share: must be <= 1, got 1.5"),
        ({"enabled": True, "survive_share": -0.1}, "spot.survive_share: must be >= 0, got -0.1"),
        ({"enabled": "yes"}, "spot.enabled: must be true or false, got 'yes'"),
        ({"enabled": True, "survive": 0.2}, "spot.survive: unknown field (allowed: enabled,"),
        (True, "spot: must be a mapping, got True"),
    ],
)
def test_bad_spot_values_are_one_line_errors(block: object, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec({**SPEC, "spot": block})
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


@needs_shared
def test_spot_on_types_without_a_spot_price_is_refused_when_resolving(tmp_path: Path) -> None:
    catalog = tmp_path / "types.csv"
    catalog.write_text("instance_type,price_usd_per_hr\ng4dn.xlarge,0.526\nr5n.large,0.149\n")
    spec = validate_spec({**SPEC, "catalog": str(catalog), "spot": {"enabled": True}})
    with pytest.raises(SpecError, match=r"spot\.enabled: none of instance_types has a spot price"):
        resolve_spec(spec)
    assert resolve_spec(validate_spec({**SPEC, "spot": {"enabled": True}})).spec.spot_enabled
