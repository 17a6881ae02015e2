"""The demo model family: deterministic training, the cache, and the validation records."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from estimator.cascades import load_validation
from provisioners.worker import family
from provisioners.worker.family import (
    FAMILY,
    MODEL_NAMES,
    VALIDATION_FORMAT,
    UnknownFamilyModelError,
    build_model,
    default_cache_dir,
    ensure_family,
    load_model,
    load_split,
    predict,
)


def document(directory: Path, name: str = "validation.json") -> Any:
    return json.loads((directory / name).read_text())


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_of(trained_family: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained_family, tmp_path / "models"))


def no_training(spec: family.ModelSpec, split: family.DigitsSplit) -> nn.Module:
    raise AssertionError(f"{spec.name} was trained again")


def test_split_is_fixed_and_stratified() -> None:
    split = load_split()
    assert split.validation_labels.size == 719 and split.train_labels.size == 1078
    assert split.train_inputs.shape == (1078, 64) and split.validation_inputs.dtype == np.float32
    shares = np.bincount(split.validation_labels) / split.validation_labels.size
    assert np.all(np.abs(shares - 0.1) < 0.01)  # every digit about a tenth of the samples
    again = load_split()
    assert again.validation_sha256() == split.validation_sha256()
    assert load_split(seed=1).validation_sha256() != split.validation_sha256()


def test_records_are_well_formed(trained_family: Path) -> None:
    records = document(trained_family)
    assert records["format"] == VALIDATION_FORMAT
    assert records["dataset"] == "sklearn-digits" and records["seed"] == family.SEED
    labels = np.array(records["labels"])
    assert labels.size == 719
    models = records["models"]
    assert isinstance(models, list)
    assert [m["name"] for m in models] == list(MODEL_NAMES)
    for entry in models:
        assert set(entry) == {"name", "accuracy", "predictions", "correct", "certainty", "params"}
        predictions = np.array(entry["predictions"])
        correct = np.array(entry["correct"])
        certainty = np.array(entry["certainty"])
        assert predictions.shape == correct.shape == certainty.shape == labels.shape
        assert correct.dtype == bool and np.array_equal(correct, predictions == labels)
        assert np.all((certainty >= 0) & (certainty <= 1))
        assert entry["accuracy"] == pytest.approx(correct.mean())
        assert isinstance(entry["params"], int) and entry["params"] > 0
    # The cascade library reads exactly this file.
    assert load_validation(trained_family / "validation.json").models == MODEL_NAMES


def test_models_differ_in_accuracy_and_size(trained_family: Path) -> None:
    models = {m["name"]: m for m in document(trained_family)["models"]}
    assert models["tiny"]["accuracy"] + 0.01 < models["large"]["accuracy"]
    assert models["large"]["accuracy"] >= 0.97
    assert models["tiny"]["params"] < models["small"]["params"] < models["medium"]["params"]


def test_confident_answers_are_mostly_right(trained_family: Path) -> None:
    # What makes a cascade work: a cheap model is right more often when it is sure.
    tiny = document(trained_family)["models"][0]
    certainty, correct = np.array(tiny["certainty"]), np.array(tiny["correct"])
    assert correct[certainty >= 0.9].mean() > correct.mean() > correct[certainty < 0.3].mean()


def test_manifest_records_seed_split_and_hashes(trained_family: Path) -> None:
    manifest = document(trained_family, "manifest.json")
    assert manifest["seed"] == family.SEED and manifest["dataset"] == "sklearn-digits"
    assert manifest["split"]["validation_samples"] == 719
    assert manifest["train_data_sha256"] == load_split().train_sha256()
    for entry, spec in zip(manifest["models"], FAMILY, strict=True):
        assert entry["hyperparameters"] == spec.hyperparameters()
        assert entry["sha256"] == digest(trained_family / entry["file"])
    assert manifest["validation"]["sha256"] == digest(trained_family / "validation.json")


def test_same_seed_gives_the_same_records(trained_family: Path, tmp_path: Path) -> None:
    again = ensure_family(tmp_path / "again")
    assert document(again) == document(trained_family)
    for name in MODEL_NAMES:
        assert digest(again / f"{name}.pt") == digest(trained_family / f"{name}.pt")


def test_a_cached_family_is_not_trained_again(
    trained_family: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(family, "_train", no_training)
    assert ensure_family(trained_family) == trained_family


def test_a_deleted_model_is_trained_again_alone(trained_family: Path, tmp_path: Path) -> None:
    cache = copy_of(trained_family, tmp_path)
    (cache / "small.pt").unlink()
    said: list[str] = []
    ensure_family(cache, progress=said.append)
    assert [line for line in said if line.startswith("training")] == [
        "training small (mlp) on sklearn-digits, seed 0"
    ]
    assert digest(cache / "small.pt") == digest(trained_family / "small.pt")
    assert document(cache) == document(trained_family)


def test_an_altered_validation_file_is_rewritten_without_training(
    trained_family: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = copy_of(trained_family, tmp_path)
    (cache / "validation.json").write_text("{}")
    monkeypatch.setattr(family, "_train", no_training)
    ensure_family(cache)
    assert document(cache) == document(trained_family)


def untrained(trained: list[str]) -> Callable[[family.ModelSpec, family.DigitsSplit], nn.Module]:
    """A stand-in for training that records which models it was asked for (fast)."""

    def fake(spec: family.ModelSpec, split: family.DigitsSplit) -> nn.Module:
        trained.append(spec.name)
        return build_model(spec)

    return fake


def test_a_mismatched_manifest_entry_retrains_that_model(
    trained_family: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = copy_of(trained_family, tmp_path)
    manifest = document(cache, "manifest.json")
    manifest["models"][0]["hyperparameters"]["epochs"] += 1
    (cache / "manifest.json").write_text(json.dumps(manifest))
    trained: list[str] = []
    monkeypatch.setattr(family, "_train", untrained(trained))
    ensure_family(cache)
    assert trained == ["tiny"]


@pytest.mark.parametrize("key", ["seed", "train_data_sha256", "format", "training_revision"])
def test_a_mismatched_manifest_header_retrains_everything(
    trained_family: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    cache = copy_of(trained_family, tmp_path)
    manifest = document(cache, "manifest.json")
    manifest[key] = 7 if key == "seed" else "something else"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    trained: list[str] = []
    monkeypatch.setattr(family, "_train", untrained(trained))
    ensure_family(cache)
    assert trained == list(MODEL_NAMES)
    assert document(cache, "manifest.json")[key] == document(trained_family, "manifest.json")[key]


def test_load_model_and_predict_reproduce_the_records(trained_family: Path) -> None:
    records = document(trained_family)
    split = load_split()
    for entry in records["models"]:
        model = load_model(entry["name"], trained_family)
        predictions, certainty = predict(model, split.validation_inputs)
        assert predictions.tolist() == entry["predictions"]
        np.testing.assert_allclose(certainty, entry["certainty"], atol=1e-6)
    # One sample at a time, as an 8x8 image: the same answer.
    first, sure = predict(
        load_model("large", trained_family), split.validation_inputs[0].reshape(8, 8)
    )
    assert first.shape == sure.shape == (1,)


def test_unknown_model_is_refused(trained_family: Path) -> None:
    with pytest.raises(UnknownFamilyModelError, match="unknown model 'huge'"):
        load_model("huge", trained_family)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "data"))
    assert default_cache_dir() == tmp_path / "data" / "models"
    monkeypatch.delenv("HETEROPLANE_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "heteroplane" / "models"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".local/share/heteroplane/models"


# --- the arrays a worker serves from, without torch ------------------------------------------


def test_the_arrays_answer_what_the_torch_modules_answer(trained_family: Path) -> None:
    split = load_split()
    arrays = family.load_arrays(MODEL_NAMES, trained_family)
    assert arrays is not None and sorted(arrays) == sorted(MODEL_NAMES)
    records = document(trained_family)
    for entry in records["models"]:
        logits = arrays[entry["name"]](split.validation_inputs)
        assert logits.dtype == np.float32 and logits.shape == (719, 10)
        with torch.inference_mode():
            expected = load_model(entry["name"], trained_family)(
                torch.from_numpy(split.validation_inputs)
            ).numpy()
        np.testing.assert_allclose(logits, expected, atol=1e-5)
        assert logits.argmax(axis=1).tolist() == entry["predictions"]


def test_a_cache_without_arrays_gets_them_without_training(
    trained_family: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = copy_of(trained_family, tmp_path)
    manifest = document(cache, "manifest.json")
    for entry in manifest["models"]:  # as an older version wrote it
        del entry["arrays"]
        (cache / f"{entry['name']}{family.ARRAYS_SUFFIX}").unlink()
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert family.load_arrays(["tiny"], cache) is None
    monkeypatch.setattr(family, "_train", no_training)
    ensure_family(cache)
    # The same bytes as the first cache's: two workers writing one cache write the same file.
    for name in MODEL_NAMES:
        assert digest(cache / f"{name}.npz") == digest(trained_family / f"{name}.npz")
    assert family.load_arrays(MODEL_NAMES, cache) is not None


@pytest.mark.parametrize(
    "change",
    ["altered arrays", "another model's arrays", "hyperparameters", "revision", "manifest"],
)
def test_arrays_the_manifest_does_not_vouch_for_are_not_served(
    trained_family: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    cache = copy_of(trained_family, tmp_path)
    manifest = document(cache, "manifest.json")
    # The model the change is to: small's entry may name medium's arrays, file and hash (the
    # same shapes but the last layer's, which an unchecked load served as small's answers).
    name, index = ("small", 1) if change == "another model's arrays" else ("large", 3)
    if change == "altered arrays":
        (cache / "large.npz").write_bytes((cache / "large.npz").read_bytes()[:-1])
    elif change == "another model's arrays":
        manifest["models"][1]["arrays"] = dict(manifest["models"][2]["arrays"])
    elif change == "hyperparameters":
        manifest["models"][3]["hyperparameters"]["dense"] += 1
    elif change == "revision":
        manifest["training_revision"] = family.TRAINING_REVISION + 1
    (cache / "manifest.json").write_text("{" if change == "manifest" else json.dumps(manifest))
    assert family.load_arrays([name], cache) is None
    # An altered file refuses that model alone; a manifest that does not match, every model.
    tiny = family.load_arrays(["tiny"], cache)
    alone = ("altered arrays", "another model's arrays", "hyperparameters")
    assert (tiny is not None) if change in alone else tiny is None
    if change not in ("altered arrays", "another model's arrays"):
        return  # the others train again (tests above)
    # ensure_family writes the arrays again without training, and they answer as the records say.
    monkeypatch.setattr(family, "_train", no_training)
    ensure_family(cache)
    mended = family.load_arrays([name], cache)
    assert mended is not None
    split = load_split()
    predictions = mended[name](split.validation_inputs[:40]).argmax(axis=1).tolist()
    assert predictions == document(cache)["models"][index]["predictions"][:40]


def test_arrays_of_another_shape_are_refused(trained_family: Path) -> None:
    with np.load(trained_family / "medium.npz") as stored:
        medium = {key: stored[key] for key in stored.files}
    with pytest.raises(family.FamilyError, match=r"model 'small': layer 1's weight is \[256, 64\]"):
        family.ArrayModel(family.model_spec("small"), medium)
    del medium["3.bias"]
    with pytest.raises(family.FamilyError, match="layer 3's weight is missing"):
        family.ArrayModel(family.model_spec("medium"), medium)


def test_unknown_model_is_refused_by_the_arrays(trained_family: Path) -> None:
    with pytest.raises(UnknownFamilyModelError, match="unknown model 'huge'"):
        family.load_arrays(["tiny", "huge"], trained_family)


def test_a_damaged_torchscript_export_is_written_again(
    trained_family: Path, tmp_path: Path
) -> None:
    """The demo pushes the family's TorchScript archives: one damaged in the cache is exported
    again (it had blocked every later demo start); one that is whole is kept, and an older
    version's sidecar without the archive's hash gets it without a new archive."""
    cache = copy_of(trained_family, tmp_path)
    path = family.export_torchscript("tiny", cache)
    sidecar = path.with_suffix(".json")
    kept = digest(path)
    assert json.loads(sidecar.read_text())["archive_sha256"] == kept
    assert digest(family.export_torchscript("tiny", cache)) == kept
    older = json.loads(sidecar.read_text())
    del older["archive_sha256"]
    sidecar.write_text(json.dumps(older))
    assert digest(family.export_torchscript("tiny", cache)) == kept
    assert json.loads(sidecar.read_text())["archive_sha256"] == kept
    path.write_bytes(path.read_bytes()[:2000])
    again = family.export_torchscript("tiny", cache)
    module = torch.jit.load(str(again))  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        logits = module(torch.zeros((1, 64)))
    assert logits.shape == (1, 10)
    assert json.loads(sidecar.read_text())["archive_sha256"] == digest(again)
