"""Tests of the instance catalog: the shipped prices, the Catalog mapping, and the file reader."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import estimator.catalog as catalog_module
from estimator.catalog import (
    CATALOG_COLUMNS,
    MIN_PRICE_USD_PER_HR,
    Catalog,
    InstanceType,
    default_catalog,
    load_catalog,
    read_catalog_file,
    write_catalog_file,
)
from estimator.errors import CatalogError, EstimatorError, UnknownInstanceTypeError

# The four types of the Kairos paper's evaluation, at the prices it used (USD/hr, us-east-1).
KAIROS_PRICES_USD_PER_HR = {
    "g4dn.xlarge": 0.526,
    "c5n.2xlarge": 0.432,
    "r5n.large": 0.149,
    "t3.xlarge": 0.1664,
}
GPU_FAMILIES = {"g4dn", "g5", "g6", "p3"}
CPU_FAMILIES = {"c5", "c5n", "c6i", "m5", "r5", "r5n", "t3"}
# Memory of one GPU of each model (GiB), as AWS lists it.
GPU_MEMORY_GIB = {"T4": 16.0, "A10G": 24.0, "L4": 24.0, "V100": 16.0}
GPU_MODEL_OF_FAMILY = {"g4dn": "T4", "g5": "A10G", "g6": "L4", "p3": "V100"}
# Rows that are not EC2 types: the machine the profiler measures (local.cpu) and the types the local
# provisioner emulates from it (docs/catalog.md, "Emulated types"). The EC2 checks skip them.
EMULATED_FAMILIES = {"local", "emu"}
EMULATED_SPEED_FACTORS = {
    "local.cpu": 1.0,
    "emu.cpu.small": 0.5,
    "emu.cpu.large": 1.0,
    "emu.gpu": 4.0,
}


def ec2_types() -> list[InstanceType]:
    return [t for t in default_catalog().values() if t.family not in EMULATED_FAMILIES]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- the default catalog --------------------------------------------------------------------


def test_default_catalog_holds_at_least_25_types_of_every_required_family() -> None:
    catalog = default_catalog()
    assert len(catalog) >= 25
    families = {t.family for t in catalog.values()}
    assert families >= GPU_FAMILIES | CPU_FAMILIES
    for family in GPU_FAMILIES | CPU_FAMILIES:
        assert sum(t.family == family for t in catalog.values()) >= 3 or family == "p3"


@pytest.mark.parametrize(("name", "price"), sorted(KAIROS_PRICES_USD_PER_HR.items()))
def test_default_catalog_has_the_kairos_prices_exactly(name: str, price: float) -> None:
    assert default_catalog().price_usd_per_hr(name) == price


def test_gpu_rows_name_their_gpu_and_cpu_rows_have_none() -> None:
    for t in ec2_types():
        if t.family in GPU_FAMILIES:
            assert t.is_gpu and t.gpus >= 1
            assert t.gpu_model == GPU_MODEL_OF_FAMILY[t.family]
            assert t.gpu_memory_gib == t.gpus * GPU_MEMORY_GIB[t.gpu_model]
        else:
            assert t.family in CPU_FAMILIES
            assert not t.is_gpu and t.gpus == 0
            assert t.gpu_model is None and t.gpu_memory_gib == 0.0


def test_default_catalog_rows_are_complete_and_named_by_family() -> None:
    for t in ec2_types():
        assert t.name.startswith(t.family + ".")
        assert t.vcpus is not None and t.vcpus > 0
        assert t.memory_gib is not None and t.memory_gib > 0
        assert t.price_usd_per_hr > 0
        assert t.speed_factor == 1.0


def test_cpu_families_price_every_gib_the_same() -> None:
    # AWS prices the sizes of each of these CPU families linearly in memory (in vCPUs too, except
    # t3, whose medium and large both have 2 vCPUs); a typo in one row breaks this.
    per_gib: dict[str, set[float]] = {}
    for t in ec2_types():
        if not t.is_gpu:
            assert t.memory_gib is not None
            per_gib.setdefault(t.family, set()).add(round(t.price_usd_per_hr / t.memory_gib, 6))
    assert all(len(rates) == 1 for rates in per_gib.values()), per_gib


def test_default_catalog_holds_the_emulated_types() -> None:
    catalog = default_catalog()
    emulated = {t.name: t for t in catalog.values() if t.family in EMULATED_FAMILIES}
    assert {name: t.speed_factor for name, t in emulated.items()} == EMULATED_SPEED_FACTORS
    assert catalog.price_usd_per_hr("local.cpu") == 0.0  # the machine at hand is paid for
    assert all(t.price_usd_per_hr > 0 for name, t in emulated.items() if name != "local.cpu")
    assert catalog["emu.gpu"].is_gpu and not catalog["emu.cpu.small"].is_gpu
    assert len(ec2_types()) == 53


def test_default_catalog_is_cached() -> None:
    assert default_catalog() is default_catalog()
    assert load_catalog() is default_catalog()


def test_catalog_columns_are_the_instance_type_fields() -> None:
    field_names = {f.name for f in dataclasses.fields(InstanceType)}
    assert set(CATALOG_COLUMNS) == (field_names - {"name"}) | {"instance_type"}


def test_module_doctests_pass() -> None:
    result = doctest.testmod(catalog_module)
    assert result.attempted > 0 and result.failed == 0


# --- InstanceType -----------------------------------------------------------------------------


def test_instance_type_derives_family_and_normalises() -> None:
    t = InstanceType("g4dn.xlarge", 1, vcpus=4, gpus=1, gpu_model="T4")
    assert t.family == "g4dn"
    assert isinstance(t.price_usd_per_hr, float)
    assert InstanceType("bare", 0.0).family == "bare"
    assert InstanceType("a.b", 0.1, family="custom").family == "custom"
    assert InstanceType("a.b", 0.1, gpu_model="").gpu_model is None
    assert InstanceType("a.b", 0.0).price_usd_per_hr == 0.0  # free is allowed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"price_usd_per_hr": -0.01}, "price_usd_per_hr: must be >= 0"),
        ({"price_usd_per_hr": 1e-12}, "price_usd_per_hr: must be 0 or >= 0.000001 USD/hr"),
        (
            {"price_usd_per_hr": 0.1, "spot_price_usd_per_hr": 1e-9},
            "spot_price_usd_per_hr: must be 0 or >= 0.000001 USD/hr",
        ),
        ({"price_usd_per_hr": math.nan}, "price_usd_per_hr: must be finite"),
        ({"price_usd_per_hr": math.inf}, "price_usd_per_hr: must be finite"),
        ({"price_usd_per_hr": True}, "price_usd_per_hr: must be a number"),
        ({"vcpus": -1}, "vcpus: must be >= 0"),
        ({"vcpus": 2.5}, "vcpus: must be a whole number"),
        ({"memory_gib": -1.0}, "memory_gib: must be >= 0"),
        ({"gpus": -1}, "gpus: must be >= 0"),
        ({"gpu_memory_gib": -16.0}, "gpu_memory_gib: must be >= 0"),
        ({"speed_factor": 0.0}, "speed_factor: must be > 0"),
        ({"speed_factor": -2.0}, "speed_factor: must be > 0"),
        ({"name": ""}, "instance_type: must be a non-empty name"),
        ({"name": "has space.large"}, "may hold only letters"),
        ({"name": "a=b"}, "may hold only letters"),
        ({"name": "x.large\n"}, "may hold only letters"),  # `$` alone let a newline through
    ],
)
def test_instance_type_rejects_bad_fields(kwargs: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"name": "x.large", "price_usd_per_hr": 0.5, **kwargs}
    with pytest.raises(CatalogError, match=message) as info:
        InstanceType(**values)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert isinstance(info.value, EstimatorError)


def test_instance_type_is_frozen() -> None:
    t = InstanceType("a.b", 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.price_usd_per_hr = 2.0  # type: ignore[misc]


# --- Catalog ----------------------------------------------------------------------------------


def small_catalog() -> Catalog:
    return Catalog([InstanceType("a.large", 1.0), InstanceType("b.large", 2.0)])


def test_catalog_is_a_mapping_in_the_given_order() -> None:
    catalog = small_catalog()
    assert catalog.names == ["a.large", "b.large"]
    assert list(catalog) == catalog.names and len(catalog) == 2
    assert catalog["b.large"].price_usd_per_hr == 2.0
    assert catalog.price_usd_per_hr("a.large") == 1.0
    not_a_name: object = 3
    assert "a.large" in catalog and "zz.large" not in catalog and not_a_name not in catalog
    assert catalog.get("zz.large") is None
    assert catalog.get("a.large") == InstanceType("a.large", 1.0)
    assert ("zz.large", InstanceType("zz.large", 1.0)) not in catalog.items()
    assert catalog == small_catalog()


def test_catalog_unknown_name_raises_with_the_known_names() -> None:
    with pytest.raises(UnknownInstanceTypeError, match=r"unknown instance type 'zz\.large'") as e:
        small_catalog()["zz.large"]
    assert e.value.instance_type == "zz.large"
    assert e.value.known == ["a.large", "b.large"]
    with pytest.raises(UnknownInstanceTypeError):
        small_catalog().price_usd_per_hr("zz.large")


def test_catalog_rejects_duplicate_names() -> None:
    with pytest.raises(CatalogError, match=r"'a\.large' appears twice"):
        Catalog([InstanceType("a.large", 1.0), InstanceType("a.large", 2.0)])


def test_catalog_is_immutable() -> None:
    catalog = small_catalog()
    with pytest.raises(TypeError):
        catalog["c.large"] = InstanceType("c.large", 1.0)  # type: ignore[index]
    with pytest.raises(AttributeError):
        catalog.extra = 1  # type: ignore[attr-defined]


def test_with_overrides_replaces_in_place_and_appends_new_types() -> None:
    catalog = small_catalog()
    merged = catalog.with_overrides([InstanceType("c.large", 3.0), InstanceType("a.large", 0.5)])
    assert merged.names == ["a.large", "b.large", "c.large"]
    assert merged.price_usd_per_hr("a.large") == 0.5
    assert catalog.price_usd_per_hr("a.large") == 1.0  # the original is untouched
    with pytest.raises(CatalogError, match="appears twice"):
        catalog.with_overrides([InstanceType("c.large", 3.0), InstanceType("c.large", 4.0)])


# --- reading catalog files ----------------------------------------------------------------------


def test_csv_override_adds_and_replaces(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "catalog.csv",
        "instance_type,price_usd_per_hr,vcpus,gpus,gpu_model,notes\n"
        "g4dn.xlarge,0.40,4,1,T4,negotiated\n"
        "emu.other,0,,1,,\n",
    )
    catalog = load_catalog(path)
    assert catalog.price_usd_per_hr("g4dn.xlarge") == 0.40
    assert catalog["g4dn.xlarge"].memory_gib is None  # a row replaces the whole type
    assert catalog["emu.other"] == InstanceType("emu.other", 0.0, gpus=1)
    assert len(catalog) == len(default_catalog()) + 1
    assert catalog.names.index("g4dn.xlarge") == default_catalog().names.index("g4dn.xlarge")


@pytest.mark.parametrize("wrapped", [False, True])
def test_json_override_adds_and_replaces(tmp_path: Path, wrapped: bool) -> None:
    rows = [
        {"instance_type": "t3.xlarge", "price_usd_per_hr": 0.2, "vcpus": 4, "memory_gib": 16},
        {"instance_type": "emu.slow", "price_usd_per_hr": 0.01, "speed_factor": 0.25},
    ]
    document = {"instance_types": rows} if wrapped else rows
    catalog = load_catalog(write(tmp_path, "catalog.json", json.dumps(document)))
    assert catalog.price_usd_per_hr("t3.xlarge") == 0.2
    assert catalog["emu.slow"].speed_factor == 0.25
    assert catalog["emu.slow"].family == "emu"
    assert "emu.slow" not in default_catalog()


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("catalog.txt", '[{"instance_type": "x.large", "price_usd_per_hr": 1}]'),
        ("catalog", "  \n instance_type,price_usd_per_hr\nx.large,1\n"),
    ],
)
def test_format_is_sniffed_without_a_known_suffix(tmp_path: Path, name: str, text: str) -> None:
    assert read_catalog_file(write(tmp_path, name, text)) == [InstanceType("x.large", 1.0)]


def test_csv_tolerates_bom_spaces_and_trailing_empty_rows(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(
        "\ufeff instance_type , price_usd_per_hr \n x.large , 1.5 \n,\n\n".encode("utf-8")
    )
    assert read_catalog_file(path) == [InstanceType("x.large", 1.5)]


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "bad.csv",
            "instance_type,vcpus\nx.large,2\n",
            ["header", "missing required column 'price_usd_per_hr'"],
        ),
        (
            "bad.csv",
            "price_usd_per_hr\n1\n",
            ["header", "missing required column 'instance_type'"],
        ),
        (
            "bad.json",
            '[{"instance_type": "x.large"}]',
            ["row 1", "price_usd_per_hr", "missing required field"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,1\ny.large,cheap\n",
            ["row 2", "price_usd_per_hr", "not a number: 'cheap'"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,-0.5\n",
            ["row 1", "price_usd_per_hr", "must be >= 0"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,inf\n",
            ["row 1", "price_usd_per_hr", "must be finite"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,nan\n",
            ["row 1", "price_usd_per_hr", "must be finite"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr,vcpus\nx.large,1,-4\n",
            ["row 1", "vcpus", "must be >= 0"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr,vcpus\nx.large,1,2.5\n",
            ["row 1", "vcpus", "not a whole number"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr,memory_gib\nx.large,1,-8\n",
            ["row 1", "memory_gib", "must be >= 0"],
        ),
        (
            "bad.json",
            '[{"instance_type": "x.large", "price_usd_per_hr": 1, "gpus": -1}]',
            ["row 1", "gpus", "must be >= 0"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr,speed_factor\nx.large,1,0\n",
            ["row 1", "speed_factor", "must be > 0"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\n  ,1\n",
            ["row 1", "instance_type", "is empty"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,1\ny.large,2\nx.large,3\n",
            ["row 3", "instance_type", "'x.large' appears twice (first at row 1"],
        ),
        (
            "bad.json",
            '{"instance_types": [{"instance_type": "x.large", "price_usd_per_hr": 1},'
            ' {"instance_type": "x.large", "price_usd_per_hr": 2}]}',
            ["row 2", "instance_type", "appears twice (first at row 1)"],
        ),
        ("bad.csv", "", ["empty file"]),
        ("bad.json", "  \n", ["empty file"]),
        ("bad.csv", "instance_type,price_usd_per_hr\n", ["holds no instance types"]),
        ("bad.json", "[]", ["holds no instance types"]),
        ("bad.json", '[{"instance_type": "x.large",', ["malformed JSON", "line 1"]),
        ("bad.json", '{"types": []}', ["JSON must be a list of objects"]),
        ("bad.json", '["x.large"]', ["row 1", "expected an object"]),
        (
            "bad.json",
            '[{"instance_type": "x.large", "price_usd_per_hr": true}]',
            ["row 1", "price_usd_per_hr", "not a number"],
        ),
        (
            "bad.json",
            '[{"instance_type": "x.large", "price_usd_per_hr": "0.5"}]',
            ["row 1", "price_usd_per_hr", "must be a JSON number, not the text '0.5'"],
        ),
        (
            "bad.json",
            '[{"instance_type": "x.large", "price_usd_per_hr": 1, "gpus": "1"}]',
            ["row 1", "gpus", "must be a JSON number, not the text '1'"],
        ),
        (
            "bad.csv",
            "instance_type,price_usd_per_hr\nx.large,1,extra\n",
            ["row 1", "more cells than the header"],
        ),
    ],
)
def test_malformed_files_fail_with_one_line_naming_file_row_and_field(
    tmp_path: Path, name: str, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(CatalogError) as info:
        read_catalog_file(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    for fragment in expected:
        assert fragment in message


def test_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_catalog(tmp_path / "absent.csv")


def test_the_default_catalog_survives_a_write_and_read(tmp_path: Path) -> None:
    for suffix in (".csv", ".json"):
        path = tmp_path / f"defaults{suffix}"
        write_catalog_file(default_catalog().values(), path)
        assert Catalog(read_catalog_file(path)) == default_catalog()


# --- round trip -------------------------------------------------------------------------------

_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=6)
_NAMES = st.builds(lambda family, size: f"{family}.{size}", _WORD, _WORD)


def _finite(max_value: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=0.0, max_value=max_value, allow_nan=False, allow_infinity=False)


@st.composite
def instance_types(draw: st.DrawFn, name: str) -> InstanceType:
    return InstanceType(
        name=name,
        price_usd_per_hr=draw(
            st.just(0.0) | st.floats(min_value=MIN_PRICE_USD_PER_HR, max_value=1e4)
        ),
        vcpus=draw(st.none() | st.integers(min_value=0, max_value=1024)),
        memory_gib=draw(st.none() | _finite(1e5)),
        gpus=draw(st.integers(min_value=0, max_value=16)),
        gpu_model=draw(st.none() | st.sampled_from(["T4", "A10G", "L4", "V100", "H100-80GB"])),
        family=draw(st.just("") | _WORD),
        gpu_memory_gib=draw(_finite(2e3)),
        speed_factor=draw(
            st.floats(min_value=0.0, max_value=100.0, exclude_min=True, allow_nan=False)
        ),
    )


@st.composite
def type_lists(draw: st.DrawFn) -> list[InstanceType]:
    names = draw(st.lists(_NAMES, min_size=1, max_size=8, unique=True))
    return [draw(instance_types(name)) for name in names]


@settings(max_examples=60, deadline=None)
@given(types=type_lists(), suffix=st.sampled_from([".csv", ".json"]))
def test_written_types_read_back_equal(types: list[InstanceType], suffix: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / f"catalog{suffix}"
        write_catalog_file(types, path)
        assert read_catalog_file(path) == types
