"""Tests of the app spec: the schema's checks, reading YAML and JSON files, and resolving a spec
against its catalog and profiles, each bad input giving one SpecError that names its field."""

from __future__ import annotations

import copy
import doctest
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import controlplane.spec as spec_module
from controlplane.policies.planner import plan_app
from controlplane.spec import (
    AppSpec,
    SpecError,
    SpecMissingProfileError,
    SpecUnknownInstanceTypeError,
    SpecUnknownModelError,
    load_spec,
    lowest_prices,
    resolve_spec,
    validate_spec,
)
from estimator.cascades import synthetic_validation, validation_document
from estimator.errors import (
    EstimatorError,
    MissingProfileError,
    UnknownInstanceTypeError,
    UnknownModelError,
)
from estimator.profiles import KAIROS_COLUMNS
from estimator.traces import Trace
from tests.conftest import KAIROS_CSV, needs_shared

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rm2.yaml"


def good_document(profiles: str = "profiles.csv") -> dict[str, Any]:
    return {
        "name": "recs",
        "models": [{"name": "rm2", "profiles": profiles}],
        "slo": {"latency_ms": 350, "percentile": 99},
        "budget_usd_per_hr": 10,
        "instance_types": ["g4dn.xlarge", "r5n.large"],
        "max_counts": {"g4dn.xlarge": 5},
    }


def cascade_document() -> dict[str, Any]:
    document = good_document()
    document["models"] = [
        {"name": "tiny", "profiles": "p.csv"},
        {"name": "small", "profiles": "p.csv"},
        {"name": "large", "profiles": "p.csv"},
    ]
    document["cascade"] = ["tiny", "small", "large"]
    document["slo"]["accuracy"] = 0.97
    return document


def with_change(path: str, value: Any, document: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``document`` with the value at a dotted path (``slo.percentile``) set;
    ``value=...`` deletes it."""
    changed = copy.deepcopy(document if document is not None else good_document())
    *parents, last = path.split(".")
    target: Any = changed
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return changed


def write_profiles_csv(path: Path, pairs: list[tuple[str, str]]) -> Path:
    """A tiny Kairos samples CSV: batch sizes 1 and 2, three samples each, per (model, type)."""
    lines = [",".join(KAIROS_COLUMNS)]
    for model, instance_type in pairs:
        for batch_size in (1, 2):
            for sample in range(3):
                lines.append(f"{model},{instance_type},{batch_size},{sample},{10 + sample},1")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_doctests() -> None:
    assert doctest.testmod(spec_module).failed == 0


# --- the schema ------------------------------------------------------------------------------


def test_good_document_validates_with_defaults() -> None:
    document = good_document()
    del document["slo"]["percentile"]
    spec = validate_spec(document)
    assert spec.slo.percentile == 99.0
    assert spec.slo.accuracy is None
    assert spec.cascade is None
    assert spec.serving_order == ["rm2"]
    assert spec.max_count("g4dn.xlarge") == 5
    assert spec.max_count("r5n.large") is None


def test_cascade_validates() -> None:
    spec = validate_spec(cascade_document())
    assert spec.serving_order == ["tiny", "small", "large"]
    assert spec.slo.accuracy == 0.97


def test_round_trip_through_model_dump() -> None:
    for document in (good_document(), cascade_document()):
        spec = AppSpec.model_validate(document)
        assert AppSpec.model_validate(spec.model_dump()) == spec
        assert AppSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(
    ("path", "value", "field", "words"),
    [
        ("colour", "red", "colour", "unknown field"),
        ("slo.p99", 1, "slo.p99", "unknown field"),
        ("models.0.weights", "w.pt", "models[0].weights", "unknown field"),
        ("name", "Recs!", "name", "lowercase"),
        ("name", "-recs", "name", "lowercase"),
        ("name", "a" * 64, "name", "at most 63"),
        ("name", ..., "name", "is required"),
        ("budget_usd_per_hr", -1, "budget_usd_per_hr", ">= 0.0001"),
        ("budget_usd_per_hr", 0, "budget_usd_per_hr", ">= 0.0001"),
        ("budget_usd_per_hr", 1e-12, "budget_usd_per_hr", ">= 0.0001"),
        ("budget_usd_per_hr", "ten", "budget_usd_per_hr", "must be a number"),
        ("budget_usd_per_hr", "10", "budget_usd_per_hr", "must be a number"),
        ("budget_usd_per_hr", True, "budget_usd_per_hr", "must be a number"),
        ("budget_usd_per_hr", float("inf"), "budget_usd_per_hr", "finite"),
        ("budget_usd_per_hr", float("nan"), "budget_usd_per_hr", "finite"),
        ("slo.percentile", 0, "slo.percentile", "> 0"),
        ("slo.percentile", 100, "slo.percentile", "< 100"),
        ("slo.percentile", -5, "slo.percentile", "> 0"),
        ("slo.latency_ms", 0, "slo.latency_ms", "> 0"),
        ("slo.latency_ms", 1e300, "slo.latency_ms", "<= 8.64e+07"),
        ("slo.latency_ms", ..., "slo.latency_ms", "is required"),
        ("slo.accuracy", 0, "slo.accuracy", "> 0"),
        ("slo.accuracy", 1.5, "slo.accuracy", "<= 1"),
        ("models", [], "models", "at least 1"),
        ("models.0.name", "", "models[0].name", "at least 1"),
        ("models.0.profiles", 3, "models[0].profiles", "must be text"),
        ("instance_types", [], "instance_types", "at least 1"),
        ("instance_types", "t3.xlarge", "instance_types", "must be a list"),
        ("instance_types", ["t3.xlarge", "t3.xlarge"], "instance_types[1]", "appears twice"),
        ("max_counts", {"g4dn.xlarge": -1}, "max_counts[g4dn.xlarge]", ">= 0"),
        ("max_counts", {"g4dn.xlarge": 2.5}, "max_counts[g4dn.xlarge]", "whole number"),
        ("max_counts", {"t3.xlarge": 1}, "max_counts[t3.xlarge]", "not one of instance_types"),
        (
            "max_counts",
            {"g4dn.xlarge": 0, "r5n.large": 0},
            "max_counts",
            "allows no instance of any candidate type (g4dn.xlarge, r5n.large)",
        ),
        ("cascade", ["rm2"], "cascade", "at least two models"),
        ("catalog", "", "catalog", "at least 1"),
        ("planning", {"trades": "yes"}, "planning.trades", "true or false"),
        ("planning", {"trade": True}, "planning.trade", "unknown field"),
        ("planning", True, "planning", "mapping"),
    ],
)
def test_bad_field_is_named(path: str, value: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(with_change(path, value))
    assert caught.value.field == field
    assert words in caught.value.problem
    assert str(caught.value) == f"{field}: {caught.value.problem}"
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, EstimatorError)


def test_a_count_may_be_a_number_without_a_fraction() -> None:
    """JSON has one number type: 2.0 is the count 2 (as in the API's bodies); 2.5 is not."""
    spec = validate_spec(with_change("max_counts", {"g4dn.xlarge": 2.0}))
    assert spec.max_counts == {"g4dn.xlarge": 2} and isinstance(spec.max_counts["g4dn.xlarge"], int)
    with pytest.raises(SpecError, match="whole number"):
        validate_spec(with_change("max_counts", {"g4dn.xlarge": True}))


def test_unknown_field_lists_the_allowed_ones() -> None:
    with pytest.raises(SpecError, match=r"allowed: latency_ms, percentile, accuracy"):
        validate_spec(with_change("slo.p99", 1))


def test_misspelt_key_is_named_before_the_missing_one() -> None:
    document = good_document()
    document["budget"] = document.pop("budget_usd_per_hr")
    with pytest.raises(SpecError) as caught:
        validate_spec(document)
    assert caught.value.field == "budget"


def test_duplicate_model_is_named() -> None:
    document = cascade_document()
    document["models"][2]["name"] = "tiny"
    with pytest.raises(SpecError) as caught:
        validate_spec(document)
    assert caught.value.field == "models[2].name"
    assert "appears twice" in caught.value.problem


@pytest.mark.parametrize(
    ("cascade", "field", "words"),
    [
        (["tiny", "small"], "cascade", "leaves out large"),
        (["tiny", "small", "huge"], "cascade[2]", "not one of the models"),
        (["tiny", "small", "small", "large"], "cascade[2]", "appears twice"),
        (..., "cascade", "several models need a cascade order"),
    ],
)
def test_cascade_must_match_the_models(cascade: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(with_change("cascade", cascade, cascade_document()))
    assert caught.value.field == field
    assert words in caught.value.problem


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"thresholds": [0.5]}, "thresholds", "one threshold per model but the last (2)"),
        ({"thresholds": [0.5, 1.5]}, "thresholds[1]", "in [0, 1]"),
        ({"thresholds": [0.5, -0.1]}, "thresholds[1]", "in [0, 1]"),
        ({"validation": "v.json"}, "thresholds", "need the cascade's thresholds"),
        ({"thresholds": [0.5, 0.5], "validation": ""}, "validation", "at least 1"),
    ],
)
def test_cascade_thresholds_and_records_are_checked(
    changes: dict[str, Any], field: str, words: str
) -> None:
    document = cascade_document()
    document.update(changes)
    with pytest.raises(SpecError) as caught:
        validate_spec(document)
    assert caught.value.field == field
    assert words in caught.value.problem


@pytest.mark.parametrize("key", ["thresholds", "validation"])
def test_thresholds_and_records_need_a_cascade(key: str) -> None:
    value: Any = [0.5] if key == "thresholds" else "v.json"
    with pytest.raises(SpecError) as caught:
        validate_spec(with_change(key, value))
    assert caught.value.field == key
    assert "cascade only" in caught.value.problem


def test_validation_records_are_loaded_and_checked(tmp_path: Path) -> None:
    pairs = [(m, t) for m in ("tiny", "large") for t in ("g4dn.xlarge", "r5n.large")]
    write_profiles_csv(tmp_path / "p.csv", pairs)
    document = cascade_document()
    document["models"] = [
        {"name": "tiny", "profiles": "p.csv"},
        {"name": "large", "profiles": "p.csv"},
    ]
    document["cascade"] = ["tiny", "large"]
    document["thresholds"] = [0.7]
    document["validation"] = "v.json"
    document.pop("max_counts")
    spec_path = tmp_path / "app.yaml"
    spec_path.write_text(json.dumps(document))
    with pytest.raises(SpecError) as caught:
        resolve_spec(load_spec(spec_path))
    assert caught.value.field == "validation" and "no such file" in caught.value.problem

    family = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], names=["tiny", "huge"])
    (tmp_path / "v.json").write_text(json.dumps(validation_document(family)))
    with pytest.raises(SpecError) as caught:
        resolve_spec(load_spec(spec_path))
    assert caught.value.field == "validation" and "no records of large" in caught.value.problem

    family = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], names=["tiny", "large"])
    (tmp_path / "v.json").write_text(json.dumps(validation_document(family)))
    app = resolve_spec(load_spec(spec_path))
    assert app.validation is not None and app.validation.models == ("tiny", "large")
    assert app.cascade is not None and app.cascade.thresholds == (0.7,)


def test_model_validate_raises_a_validation_error_carrying_the_field() -> None:
    # The API calls model_validate directly; the message still names the field.
    with pytest.raises(ValueError, match=r"several models need a cascade order"):
        AppSpec.model_validate(with_change("cascade", ..., cascade_document()))


@pytest.mark.parametrize("document", [None, [], "recs"])
def test_document_must_be_a_mapping(document: object) -> None:
    with pytest.raises(SpecError, match="a mapping of fields"):
        validate_spec(document)


# --- reading files ---------------------------------------------------------------------------


def test_yaml_file_loads_and_anchors_relative_paths(tmp_path: Path) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    document = good_document("../data/profiles.csv")
    document["catalog"] = "/abs/catalog.csv"
    spec_path = folder / "recs.yaml"
    spec_path.write_text(yaml.safe_dump(document), encoding="utf-8")
    spec = load_spec(spec_path)
    assert spec.models[0].profiles == str((tmp_path / "data" / "profiles.csv").resolve())
    assert spec.catalog == "/abs/catalog.csv"


@pytest.mark.parametrize("indent", [None, 2, "\t"])
def test_json_file_parses_too(tmp_path: Path, indent: int | str | None) -> None:
    spec_path = tmp_path / "recs.json"
    spec_path.write_text(json.dumps(good_document(), indent=indent), encoding="utf-8")
    spec = load_spec(spec_path)
    assert spec.name == "recs"
    assert spec.models[0].profiles == str(tmp_path.resolve() / "profiles.csv")


def test_yaml_reads_exponent_floats_as_yaml_1_2_does(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 rules read 1e9 as a string ("must be a number, got '1e9'")."""
    spec_path = tmp_path / "recs.yaml"
    text = yaml.safe_dump(good_document())
    text = text.replace("latency_ms: 350", "latency_ms: 35e1")
    text = text.replace("budget_usd_per_hr: 10", "budget_usd_per_hr: 105.5e-1")
    assert "35e1" in text and "105.5e-1" in text
    spec_path.write_text(text, encoding="utf-8")
    spec = load_spec(spec_path)
    assert (spec.slo.latency_ms, spec.budget_usd_per_hr) == (350.0, 10.55)


def test_json_in_a_yaml_file_parses(tmp_path: Path) -> None:
    spec_path = tmp_path / "recs.yaml"
    spec_path.write_text(json.dumps(good_document()), encoding="utf-8")
    assert load_spec(spec_path).budget_usd_per_hr == 10.0


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.yaml", "name: recs\nmodels: [\n  - oops: : :\n", "malformed YAML at line 3"),
        ("bad.yaml", "name: recs\n\tslo: 1\n", "malformed YAML at line 2"),
        ("dup.yaml", "name: recs\nname: other\n", "'name' appears twice"),
        ("bad.json", '{"name": "recs",\n "models": }', "malformed JSON at line 2"),
        ("empty.yaml", "", "got empty"),
        ("list.yaml", "- a\n- b\n", "got list"),
    ],
)
def test_malformed_file_names_the_line(tmp_path: Path, name: str, text: str, words: str) -> None:
    spec_path = tmp_path / name
    spec_path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        load_spec(spec_path)
    assert words in str(caught.value)
    assert str(caught.value).startswith(str(spec_path))
    assert "\n" not in str(caught.value)


def test_bad_field_in_a_file_names_file_and_field(tmp_path: Path) -> None:
    spec_path = tmp_path / "recs.yaml"
    spec_path.write_text(
        "name: recs\nmodels: [{name: rm2, profiles: p.csv}]\nslo: {latency_ms: 350,"
        " percentile: 100}\nbudget_usd_per_hr: 10\ninstance_types: [t3.xlarge]\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError) as caught:
        load_spec(spec_path)
    assert caught.value.field == "slo.percentile"
    assert str(caught.value) == f"{spec_path}: slo.percentile: must be < 100, got 100"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.yaml")


def test_a_file_past_the_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """7.5 MB of YAML took a minute to be refused for a missing field."""
    path = tmp_path / "huge.yaml"
    path.write_text("name: t\nmodels:\n" + "  - {name: m, profiles: x.csv}\n" * 40_000)
    with pytest.raises(SpecError, match=r"larger than 1,048,576 bytes: not an app spec"):
        load_spec(path)


# --- resolving against catalog and profiles --------------------------------------------------


@pytest.fixture
def small_app(tmp_path: Path) -> Path:
    """A spec whose profile file has rm2 on g4dn.xlarge and r5n.large, and ncf on g4dn only."""
    write_profiles_csv(
        tmp_path / "profiles.csv",
        [("rm2", "g4dn.xlarge"), ("rm2", "r5n.large"), ("ncf", "g4dn.xlarge")],
    )
    spec_path = tmp_path / "recs.json"
    spec_path.write_text(json.dumps(good_document()), encoding="utf-8")
    return spec_path


def test_resolve_loads_catalog_profiles_and_prices(small_app: Path) -> None:
    app = resolve_spec(load_spec(small_app))
    assert app.instance_types == ["g4dn.xlarge", "r5n.large"]
    assert dict(app.prices_usd_per_hr) == {"g4dn.xlarge": 0.526, "r5n.large": 0.149}
    assert app.profile("rm2", "r5n.large").max_batch_size == 2
    assert app.catalog.price_usd_per_hr("t3.xlarge") == 0.1664
    with pytest.raises(UnknownModelError):
        app.profile("ncf", "g4dn.xlarge")


def test_resolve_with_base_dir_anchors_an_api_body(small_app: Path) -> None:
    spec = validate_spec(good_document())
    app = resolve_spec(spec, base_dir=small_app.parent)
    assert app.spec.models[0].profiles == str(small_app.parent.resolve() / "profiles.csv")


def test_missing_profile_for_a_candidate_type(small_app: Path) -> None:
    document = with_change("models.0.name", "ncf")
    small_app.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(SpecMissingProfileError) as caught:
        resolve_spec(load_spec(small_app))
    error = caught.value
    assert error.field == "models[0].profiles"
    assert "missing profile for candidate type 'r5n.large' of model 'ncf'" in str(error)
    assert isinstance(error, MissingProfileError)
    assert (error.model, error.instance_type) == ("ncf", "r5n.large")


def test_unknown_model(small_app: Path) -> None:
    small_app.write_text(json.dumps(with_change("models.0.name", "dlrm")), encoding="utf-8")
    with pytest.raises(SpecUnknownModelError) as caught:
        resolve_spec(load_spec(small_app))
    assert caught.value.field == "models[0].name"
    assert "it has: ncf, rm2" in str(caught.value)
    assert isinstance(caught.value, UnknownModelError)


def test_unknown_instance_type(small_app: Path) -> None:
    document = with_change("instance_types", ["g4dn.xlarge", "g9.huge"])
    small_app.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(SpecUnknownInstanceTypeError) as caught:
        resolve_spec(load_spec(small_app))
    assert caught.value.field == "instance_types[1]"
    assert caught.value.instance_type == "g9.huge"
    assert isinstance(caught.value, UnknownInstanceTypeError)
    assert str(caught.value).startswith("instance_types[1]: unknown instance type 'g9.huge'")


def test_catalog_file_adds_a_type(small_app: Path) -> None:
    folder = small_app.parent
    (folder / "catalog.csv").write_text("instance_type,price_usd_per_hr\nemu.small,0.05\n")
    write_profiles_csv(folder / "profiles.csv", [("rm2", "g4dn.xlarge"), ("rm2", "emu.small")])
    document = with_change("instance_types", ["g4dn.xlarge", "emu.small"])
    document["catalog"] = "catalog.csv"
    small_app.write_text(json.dumps(document), encoding="utf-8")
    app = resolve_spec(load_spec(small_app))
    assert app.prices_usd_per_hr["emu.small"] == 0.05


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"catalog": "absent.csv"}, "catalog", "no such file"),
        ({"models": [{"name": "rm2", "profiles": "absent.csv"}]}, "models[0].profiles", "no such"),
        ({"budget_usd_per_hr": 0.1}, "budget_usd_per_hr", "buys no instance"),
    ],
)
def test_resolve_errors_name_the_field(
    small_app: Path, change: dict[str, Any], field: str, words: str
) -> None:
    small_app.write_text(json.dumps(good_document() | change), encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        resolve_spec(load_spec(small_app))
    assert caught.value.field == field
    assert words in caught.value.problem


@pytest.mark.parametrize(
    ("spot", "buys"),
    [
        ({"enabled": True, "survive_share": 0.0, "max_share": 1.0}, True),
        ({"enabled": True, "survive_share": 0.5}, False),  # one instance keeps an on-demand base
        ({"enabled": True, "survive_share": 0.0, "max_share": 0.8}, False),
        ({"enabled": False, "survive_share": 0.0}, False),
    ],
)
def test_a_budget_that_buys_one_instance_on_spot(
    small_app: Path, spot: dict[str, Any], buys: bool
) -> None:
    """An app that may run all spot is planned on a budget between the cheapest type's spot
    and on-demand prices (refused as buying no instance before: the check read on-demand
    prices while the service ran exactly such a fleet)."""
    folder = small_app.parent
    (folder / "catalog.csv").write_text(
        "instance_type,price_usd_per_hr,spot_price_usd_per_hr\nemu.small,0.05,0.015\n"
    )
    write_profiles_csv(folder / "profiles.csv", [("rm2", "emu.small")])
    document = with_change("instance_types", ["emu.small"])
    document |= {"catalog": "catalog.csv", "budget_usd_per_hr": 0.03, "spot": spot}
    document.pop("max_counts", None)
    small_app.write_text(json.dumps(document), encoding="utf-8")
    if buys:
        app = resolve_spec(load_spec(small_app))
        assert lowest_prices(app.spec, app.catalog) == {"emu.small": 0.015}
        # A model still to be profiled: its profile run's workers run on demand.
        assert lowest_prices(app.spec, app.catalog, measuring=True) == {"emu.small": 0.05}
        return
    with pytest.raises(SpecError, match=r"buys no instance: the cheapest candidate, emu\.small,"):
        resolve_spec(load_spec(small_app))


def test_malformed_catalog_is_named(small_app: Path) -> None:
    (small_app.parent / "catalog.csv").write_text("instance_type,price_usd_per_hr\nx.y,-1\n")
    small_app.write_text(json.dumps(good_document() | {"catalog": "catalog.csv"}))
    with pytest.raises(SpecError) as caught:
        resolve_spec(load_spec(small_app))
    assert caught.value.field == "catalog"
    assert "price_usd_per_hr" in caught.value.problem


# --- the example -----------------------------------------------------------------------------


def test_example_spec_validates() -> None:
    spec = load_spec(EXAMPLE)
    assert spec.model_names == ["rm2"]
    assert spec.slo.latency_ms == 350.0
    assert spec.instance_types == ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"]


@needs_shared
def test_example_spec_resolves() -> None:
    spec = load_spec(EXAMPLE)
    if Path(spec.models[0].profiles) != KAIROS_CSV.resolve():
        pytest.skip("the shared data is not beside the checkout (HETEROPLANE_SHARED is set)")
    app = resolve_spec(spec)
    assert set(app.prices_usd_per_hr) == set(spec.instance_types)
    for instance_type in spec.instance_types:
        assert app.profile("rm2", instance_type).max_batch_size == 1000


@needs_shared
def test_the_dien_example_resolves() -> None:
    spec = load_spec(EXAMPLE.with_name("dien.yaml"))
    if Path(spec.models[0].profiles) != KAIROS_CSV.resolve():
        pytest.skip("the shared data is not beside the checkout (HETEROPLANE_SHARED is set)")
    assert spec.model_names == ["dien"] and spec.slo.latency_ms == 35.0
    app = resolve_spec(spec)
    for instance_type in spec.instance_types:
        assert app.profile("dien", instance_type).max_batch_size == 1000


# --- inputs that once crashed the service --------------------------------------------------------


def test_an_absurd_budget_is_refused_with_its_bound() -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(with_change("budget_usd_per_hr", 1e308))
    assert caught.value.field == "budget_usd_per_hr"
    assert validate_spec(with_change("budget_usd_per_hr", 1e6)).budget_usd_per_hr == 1e6


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("models.0.profiles", "models[0].profiles"),
        ("validation", "validation"),
        ("catalog", "catalog"),
    ],
)
def test_a_path_with_a_nul_byte_is_named(path: str, field: str) -> None:
    document = cascade_document() if path == "validation" else good_document()
    if path == "validation":
        document["thresholds"] = [0.5, 0.5]
    with pytest.raises(SpecError) as caught:
        validate_spec(with_change(path, "bad\x00name", document))
    assert caught.value.field == field and "NUL" in str(caught.value)


def test_a_free_type_needs_a_cap_and_then_plans(tmp_path: Path) -> None:
    pairs = [("rm2", "g4dn.xlarge"), ("rm2", "local.cpu")]
    write_profiles_csv(tmp_path / "profiles.csv", pairs)
    document = with_change("instance_types", ["g4dn.xlarge", "local.cpu"])
    with pytest.raises(SpecError) as caught:
        resolve_spec(validate_spec(document), base_dir=tmp_path)
    assert caught.value.field == "instance_types[1]" and "max_counts" in str(caught.value)
    capped = with_change("max_counts", {"local.cpu": 2}, document)
    app = resolve_spec(validate_spec(capped), base_dir=tmp_path)
    rng = np.random.default_rng(0)
    arrival_s = np.cumsum(rng.exponential(1 / 50.0, 2_000))
    plan = plan_app(app, Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64)))
    assert plan.fleet.get("local.cpu", 0) <= 2


def test_the_data_directory_refusal_says_what_a_command_line_user_can_do(tmp_path: Path) -> None:
    """``heteroplane app apply -f FILE`` sends a relative path made absolute beside FILE, so a
    path relative to the data directory can never pass from the command line: the refusal names
    the path as sent and the data directory, and says that an absolute path there works."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "profiles.csv").write_text("model,instance_type,batch_size,infer_ms\n")
    specs = tmp_path / "specs"
    specs.mkdir()
    body = {
        "name": "toy",
        "models": [{"name": "m", "profiles": "profiles.csv"}],
        "slo": {"latency_ms": 40},
        "budget_usd_per_hr": 1.0,
        "instance_types": ["r5n.large"],
    }
    (specs / "toy.yaml").write_text(yaml.safe_dump(body))

    with pytest.raises(SpecError) as refused:
        spec_module.confine_paths(load_spec(specs / "toy.yaml"), data_dir)
    message = str(refused.value)
    assert message.startswith("models[0].profiles: must name a file in the service's data")
    assert f"data directory, {data_dir.resolve()};" in message
    assert f"; {specs.resolve() / 'profiles.csv'} is outside it" in message
    assert "absolute path there" in message and "heteroplane app apply" in message
    # What it says works: the absolute path under the data directory, from any spec file.
    absolute = {**body, "models": [{"name": "m", "profiles": str(data_dir / "profiles.csv")}]}
    (specs / "toy.yaml").write_text(yaml.safe_dump(absolute))
    spec_module.confine_paths(load_spec(specs / "toy.yaml"), data_dir)
    # A relative path in a body sent as is: how it was taken under the data directory.
    relative = validate_spec({**body, "models": [{"name": "m", "profiles": "../x/p.csv"}]})
    with pytest.raises(SpecError) as refused:
        spec_module.confine_paths(relative, data_dir)
    assert f"; ../x/p.csv, taken as {tmp_path.resolve() / 'x' / 'p.csv'} is outside" in str(
        refused.value
    )
