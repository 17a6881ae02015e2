"""Registered models in the app spec: ``artifact`` (NAME or NAME@VERSION), ``certainty``, one of
profiles/artifact; the resolver's artifact lookup, pinning, measured profiles and the cascade's
shared inputs; the plan preview refused without profiles."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.apps.plans import require_profiles
from controlplane.apps.resolver import MEASURED_RECHECK_S, AppResolver
from controlplane.cli import build_parser
from controlplane.db.store import ModelVersionRecord
from controlplane.errors import NotFoundError, ProfilesNotMeasuredError
from controlplane.spec import SpecError, parse_artifact, resolve_spec, validate_spec
from estimator.errors import EstimatorError, UnknownModelError
from estimator.profiles import LatencyProfile, profiles_document
from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature, TensorSpec

SMALL, GPU = "emu.cpu.small", "emu.gpu"
SHA = "ab" * 32


def version(name: str, number: int, signature: ModelSignature = FAMILY_SIGNATURE) -> Any:
    return ModelVersionRecord(
        name=name,
        version=number,
        format="onnx",
        sha256=SHA,
        size_bytes=10,
        signature=signature,
        uri=f"file:///registry/{name}-{number}.onnx",
        created_at=datetime(2024, 1, 1, tzinfo=UTC),
    )


def registry(*records: Any) -> Callable[[str, int | None], Any]:
    """A lookup over ``records`` as the store's get_model_version answers."""

    def lookup(name: str, number: int | None) -> Any:
        found = [r for r in records if r.name == name and number in (None, r.version)]
        if not found:
            raise NotFoundError("model", name if number is None else f"{name}@{number}")
        return max(found, key=lambda r: r.version)

    return lookup


def document(**models: Any) -> dict[str, Any]:
    entries = [{"name": name, **fields} for name, fields in models.items()]
    spec: dict[str, Any] = {
        "name": "digits",
        "models": entries,
        "slo": {"latency_ms": 300},
        "budget_usd_per_hr": 5,
        "instance_types": [SMALL, GPU],
    }
    if len(entries) > 1:
        spec["cascade"] = list(models)
    return spec


def measured(*models: str, types: tuple[str, ...] = (SMALL, GPU)) -> dict[str, Any]:
    return profiles_document(
        [
            LatencyProfile(m, t, np.array([1, 4]), (np.array([5.0, 6.0]), np.array([9.0])))
            for m in models
            for t in types
        ]
    )


# --- the schema ------------------------------------------------------------------------------


def test_an_artifact_model_needs_no_profiles_and_certainty_defaults_to_margin() -> None:
    spec = validate_spec(document(small={"artifact": "digits-small"}))
    (model,) = spec.models
    assert model.profiles is None and model.certainty == "margin"
    assert model.artifact_ref == ("digits-small", None)


def test_a_model_with_neither_profiles_nor_artifact_is_an_error_naming_it() -> None:
    with pytest.raises(SpecError) as error:
        validate_spec(document(small={"certainty": "margin"}))
    assert error.value.field == "models[0]"
    assert "profiles" in error.value.problem and "artifact" in error.value.problem


@pytest.mark.parametrize(
    ("text", "expected"),
    [("digits", ("digits", None)), ("digits@3", ("digits", 3)), ("a-1@12", ("a-1", 12))],
)
def test_name_at_version_parses(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_artifact(text) == expected


@pytest.mark.parametrize(
    "text", ["Digits", "digits@", "digits@0", "digits@x", "-a", "a@1@2", "digits@\u0664"]
)
def test_a_bad_artifact_reference_names_the_field(text: str) -> None:
    with pytest.raises(SpecError) as error:
        validate_spec(document(small={"artifact": text}))
    assert error.value.field == "models[0].artifact"
    assert str(error.value).startswith("models[0].artifact: ")


def test_a_version_too_long_says_so() -> None:
    # It said "must be a whole number >= 1" of 99999999999999999999.
    with pytest.raises(SpecError, match="at most 9 digits"):
        parse_artifact("digits@99999999999999999999")


def test_certainty_is_margin_or_max_prob() -> None:
    spec = validate_spec(document(small={"artifact": "s", "certainty": "max_prob"}))
    assert spec.models[0].certainty == "max_prob"
    with pytest.raises(SpecError) as error:
        validate_spec(document(small={"artifact": "s", "certainty": "entropy"}))
    assert error.value.field == "models[0].certainty"
    assert "margin" in error.value.problem and "max_prob" in error.value.problem


def test_an_unknown_model_field_lists_artifact_and_certainty() -> None:
    with pytest.raises(SpecError) as error:
        validate_spec(document(small={"artifact": "s", "artefact": "s"}))
    assert error.value.field == "models[0].artefact"
    assert "artifact" in error.value.problem and "certainty" in error.value.problem


# --- resolving -------------------------------------------------------------------------------


def test_registration_pins_the_latest_version_and_resolves_the_reference(tmp_path: Path) -> None:
    resolver = AppResolver(tmp_path, artifacts=registry(version("s", 1), version("s", 2)))
    resolved = resolver.check(document(small={"artifact": "s", "certainty": "max_prob"}))
    assert resolved.spec.models[0].artifact == "s@2"
    artifact = resolved.artifacts["small"]
    assert (artifact.ref.name, artifact.ref.model, artifact.ref.version) == ("small", "s", 2)
    assert artifact.signature == FAMILY_SIGNATURE
    assert artifact.certainty == "max_prob" and resolved.certainty("small") == "max_prob"
    # Nothing measured yet: registered, but every candidate type lacks a profile.
    assert dict(resolved.unprofiled) == {"small": (SMALL, GPU)}
    assert "small" not in resolved.profiles


def test_a_pinned_version_stays_pinned(tmp_path: Path) -> None:
    resolver = AppResolver(tmp_path, artifacts=registry(version("s", 1), version("s", 2)))
    resolved = resolver.check(document(small={"artifact": "s@1"}))
    assert resolved.spec.models[0].artifact == "s@1"
    assert resolved.artifacts["small"].ref.version == 1


@pytest.mark.parametrize("reference", ["nope", "s@7"])
def test_an_unknown_artifact_is_a_spec_error_naming_the_field(
    tmp_path: Path, reference: str
) -> None:
    resolver = AppResolver(tmp_path, artifacts=registry(version("s", 1)))
    with pytest.raises(SpecError) as error:
        resolver.check(document(small={"artifact": reference}))
    assert error.value.field == "models[0].artifact"
    assert "registry has no" in error.value.problem


def test_a_type_dearer_than_the_budget_is_named_as_the_way_out(tmp_path: Path) -> None:
    """profile run refuses a worker the budget cannot pay for, so an unprofiled type dearer than
    the whole budget is not fixed by another profile run: the refusal says to drop it."""
    resolver = AppResolver(
        tmp_path,
        artifacts=registry(version("s", 1)),
        measured=lambda _app: measured("small", types=(SMALL,)),
    )
    spec = {**document(small={"artifact": "s"}), "budget_usd_per_hr": 0.3}
    with pytest.raises(ProfilesNotMeasuredError) as refused:
        require_profiles(resolver.check(spec))
    message = str(refused.value)
    assert message.startswith(f"app digits has no latency profiles for model small on {GPU}:")
    assert f"{GPU} alone cost(s) more than the budget of 0.3 USD/hr: drop it from" in message
    assert "--types TYPES" in message


def test_measured_profiles_make_the_app_plannable(tmp_path: Path) -> None:
    stored: dict[str, Any] = {}
    resolver = AppResolver(
        tmp_path, artifacts=registry(version("s", 1)), measured=lambda app: stored.get(app)
    )
    spec = document(small={"artifact": "s"})
    with pytest.raises(ProfilesNotMeasuredError) as refused:
        require_profiles(resolver.check(spec))
    assert str(refused.value) == (
        "app digits has no latency profiles for model small: run heteroplane profile run"
        " --app digits"
    )
    # None stored is not kept: profiles another process stores are seen at the next resolve
    # (a loops process whose serving process ran the profiles, told nothing).
    stored["digits"] = measured("small")
    resolved = resolver.check(spec)
    assert not resolved.unprofiled
    require_profiles(resolved)
    assert resolved.profile("small", GPU).batch_sizes.tolist() == [1, 4]
    # Stored ones are read once and kept until the resolver is told.
    stored["digits"] = measured("small", types=(SMALL,))
    assert resolver.check(spec).profile("small", GPU).batch_sizes.tolist() == [1, 4]
    resolver.invalidate("digits")
    with pytest.raises(EstimatorError):
        resolver.check(spec).profile("small", GPU)


def test_measured_profiles_are_read_again_after_a_while(tmp_path: Path) -> None:
    # Another process may store new profiles and tell this one nothing (a loops process whose
    # serving process ran the profiles again, another replica).
    now = [0.0]
    stored: dict[str, Any] = {"digits": measured("small")}
    reads: list[str] = []

    def source(app: str) -> Any:
        reads.append(app)
        return stored.get(app)

    resolver = AppResolver(
        tmp_path, artifacts=registry(version("s", 1)), measured=source, clock_s=lambda: now[0]
    )
    spec = document(small={"artifact": "s"})
    first = resolver.check(spec)
    stored["digits"] = measured("small", types=(SMALL,))
    now[0] = MEASURED_RECHECK_S - 1.0
    assert resolver.check(spec).profile("small", GPU) is first.profile("small", GPU)
    assert len(reads) == 1
    now[0] = MEASURED_RECHECK_S + 1.0
    with pytest.raises(EstimatorError):  # the new document: measured on SMALL only
        resolver.check(spec).profile("small", GPU)
    assert len(reads) == 2
    # The same document read again keeps the resolved app.
    kept = resolver.check(spec)
    now[0] = 3 * MEASURED_RECHECK_S
    again = resolver.check(spec)
    assert len(reads) == 3 and again.profiles is kept.profiles


def test_an_unprofiled_models_profile_says_to_profile_it_not_unknown_model(tmp_path: Path) -> None:
    resolver = AppResolver(tmp_path, artifacts=registry(version("s", 1)), measured=lambda _a: None)
    resolved = resolver.check(document(small={"artifact": "s"}))
    with pytest.raises(UnknownModelError) as refused:  # what the loops catch, as before
        resolved.profile("small", GPU)
    assert str(refused.value) == (
        "app digits has no latency profiles for model small yet: run heteroplane profile run"
        " --app digits"
    )
    with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
        resolved.profile("nope", GPU)


def test_profiles_measured_on_some_types_only_name_the_missing_ones(tmp_path: Path) -> None:
    resolver = AppResolver(
        tmp_path,
        artifacts=registry(version("s", 1)),
        measured=lambda _app: measured("small", types=(SMALL,)),
    )
    resolved = resolver.check(document(small={"artifact": "s"}))
    assert dict(resolved.unprofiled) == {"small": (GPU,)}
    with pytest.raises(ProfilesNotMeasuredError, match=f"for model small on {GPU}:"):
        require_profiles(resolved)
    with pytest.raises(EstimatorError):  # what the loops catch: they skip the app
        resolved.profile("small", SMALL)


def test_an_artifact_model_with_a_profile_file_takes_the_file(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps(measured("small")))
    resolver = AppResolver(tmp_path, artifacts=registry(version("s", 1)))
    resolved = resolver.check(document(small={"artifact": "s", "profiles": "p.json"}))
    assert not resolved.unprofiled and "small" in resolved.artifacts


def test_cascade_members_must_share_the_input_signature(tmp_path: Path) -> None:
    other = ModelSignature(
        (TensorSpec("pixels", "FP32", (-1, 8, 8)),), (TensorSpec("logits", "FP32", (-1, 10)),)
    )
    lookup = registry(version("a", 1), version("b", 1), version("c", 1, other))
    resolver = AppResolver(tmp_path, artifacts=lookup)
    fine = resolver.check(document(small={"artifact": "a"}, large={"artifact": "b"}))
    assert set(fine.artifacts) == {"small", "large"}
    with pytest.raises(SpecError) as error:
        resolver.check(document(small={"artifact": "a"}, large={"artifact": "c"}))
    assert error.value.field == "models[1].artifact"
    assert "same inputs" in error.value.problem and "pixels:FP32:-1x8x8" in error.value.problem


def test_offline_an_artifact_model_needs_its_profile_file(tmp_path: Path) -> None:
    spec = validate_spec(document(small={"artifact": "s"}))
    with pytest.raises(SpecError) as error:
        resolve_spec(spec, tmp_path)
    assert error.value.field == "models[0].artifact"
    (tmp_path / "p.json").write_text(json.dumps(measured("small")))
    with_file = validate_spec(document(small={"artifact": "s", "profiles": "p.json"}))
    resolved = resolve_spec(with_file, tmp_path)
    assert not resolved.artifacts and not resolved.unprofiled


def test_offline_the_artifact_error_names_a_command_that_exists(tmp_path: Path) -> None:
    """The way out it names is the command that registers an app (``app apply``): the command
    line has no ``app register``."""
    spec = validate_spec(document(small={"artifact": "s"}))
    with pytest.raises(SpecError) as error:
        resolve_spec(spec, tmp_path)
    named = re.search(r"\(heteroplane ([^)]*)\)", error.value.problem)
    assert named is not None
    build_parser().parse_args(named.group(1).split())
