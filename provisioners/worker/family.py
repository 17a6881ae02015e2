"""The demo model family: four PyTorch classifiers of rising cost and accuracy on digit images.

This module owns the family a demo app serves and the tests use: the architectures (``tiny``, a
logistic layer on the 8x8 pixels; ``small`` and ``medium``, MLPs; ``large``, a CNN), the data set
(scikit-learn's digits, which ships inside the package, so nothing is downloaded) with its fixed,
stratified train/validation split, deterministic training at first use, the on-disk cache, the
validation records that cascades are evaluated on, and the models' forward pass in numpy that the
worker agent serves (``load_arrays``; ``load_model`` / ``predict`` give the torch modules). torch
is imported only by what trains, loads or exports a torch module: a worker serving a trained
family does not import it.

Cache (``$HETEROPLANE_DATA_DIR/models``, else ``~/.local/share/heteroplane/models``, or under
``$XDG_DATA_HOME`` when that is set; an argument overrides): one state dict per model
(``NAME.pt``) and its arrays (``NAME.npz``), ``validation.json`` and ``manifest.json``. A cache
without the arrays (an older version's) gets them at the next ``ensure_family``, without
training. The manifest records the seed, the split,
each model's hyper-parameters, accuracy and parameter count, and SHA-256 hashes of the training and
validation data and of every file. A model is trained again when its file is missing or altered or
its manifest entry does not match the code; everything is trained again when the data, seed or
split differ. Each model is seeded from (seed, name), so training one model again gives the same
weights as training the whole family.

Validation records (``validation.json``, format ``heteroplane.validation/v1``; CascadeServe
appendix B): for every model, per validation sample, the prediction, whether it is correct and its
certainty = top-1 minus top-2 softmax score, in [0, 1]. Models are listed cheapest first.

Like the rest of ``provisioners/``, this imports nothing else from the repository.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ARRAYS_SUFFIX",
    "DATASET",
    "FAMILY",
    "MODEL_NAMES",
    "SEED",
    "SIGNATURE_FILE",
    "TORCHSCRIPT_DIR",
    "VALIDATION_FORMAT",
    "ArrayModel",
    "DigitsSplit",
    "FamilyError",
    "ModelSpec",
    "UnknownFamilyModelError",
    "build_model",
    "default_cache_dir",
    "default_data_dir",
    "ensure_family",
    "export_torchscript",
    "layer_plan",
    "load_arrays",
    "load_model",
    "load_split",
    "model_spec",
    "parameter_count",
    "predict",
    "read_validation",
    "validation_document",
]

DATASET = "sklearn-digits"
VALIDATION_FORMAT = "heteroplane.validation/v1"
MANIFEST_FORMAT = "heteroplane.family/v1"
MANIFEST_FILE = "manifest.json"
VALIDATION_FILE = "validation.json"
SEED = 0
# Raise when the training procedure changes in a way the hyper-parameters do not show: every cache
# made by an older revision is then trained again.
TRAINING_REVISION = 1
# 40% of the 1797 digits (719 samples) for validation: enough that one sample moves accuracy by
# 0.14 points, so the 0.5-point comparisons of the cascade acceptance test mean something.
VALIDATION_SHARE = 0.4
N_FEATURES = 64  # 8x8 pixels
N_CLASSES = 10
PIXEL_MAX = 16.0  # sklearn's digits hold pixel intensities 0..16

ProgressFn = Callable[[str], None]


class FamilyError(Exception):
    """Root of the errors of the model family."""


class UnknownFamilyModelError(FamilyError, ValueError):
    """A model name that is not in the family."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown model {name!r} (the family: {', '.join(MODEL_NAMES)})")
        self.name = name


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model of the family: its architecture and how it is trained.

    ``kind`` is ``linear`` (a logistic layer), ``mlp`` (``widths`` are the hidden layers) or ``cnn``
    (``widths`` are the channels of 3x3 convolutions, each after the first followed by a 2x2 max
    pool, then a dense layer of ``dense`` units).
    """

    name: str
    kind: str
    widths: tuple[int, ...]
    dense: int
    epochs: int
    batch_size: int
    learning_rate: float
    weight_decay: float

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "widths": list(self.widths),
            "dense": self.dense,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
            "optimizer": "adam, cosine learning-rate decay",
        }


# Cheapest first; accuracies and training times on the fixed split are in docs/cascades.md. The
# widths set the compute gap: tiny is one 64x10 product per query (640 multiply-adds), small about
# 1.2 k, medium 84 k, and large three convolutions of 32, 64 and 128 channels (about 2.4 M, ~3,800x
# tiny). Training the family takes about 15 s on one CPU core, most of it the CNN.
FAMILY: tuple[ModelSpec, ...] = (
    ModelSpec("tiny", "linear", (), 0, 30, 64, 0.02, 0.0),
    ModelSpec("small", "mlp", (16,), 0, 30, 64, 0.01, 1e-4),
    ModelSpec("medium", "mlp", (256, 256), 0, 60, 64, 0.003, 1e-3),
    ModelSpec("large", "cnn", (32, 64, 128), 128, 15, 32, 0.002, 1e-4),
)
MODEL_NAMES: tuple[str, ...] = tuple(spec.name for spec in FAMILY)


def model_spec(name: str) -> ModelSpec:
    """The spec of the family model ``name``."""
    for spec in FAMILY:
        if spec.name == name:
            return spec
    raise UnknownFamilyModelError(name)


@functools.cache
def _pixels_class() -> type[nn.Module]:
    """The module that scales raw pixel intensities (0..16) to [0, 1], optionally shaped as 1x8x8
    images (defined at first use: importing this module does not import torch)."""
    from torch import nn

    class Pixels(nn.Module):
        def __init__(self, image: bool) -> None:
            super().__init__()
            self.image = image

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            scaled = inputs / PIXEL_MAX
            return scaled.reshape(-1, 1, 8, 8) if self.image else scaled.reshape(-1, N_FEATURES)

    return Pixels


def layer_plan(spec: ModelSpec) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The layers of ``spec`` after the pixel scaling, in order: ``("dense", (out, in))``,
    ``("conv", (out, in, 3, 3))`` (3x3, padding 1), ``("relu", ())``, ``("pool", ())`` (2x2
    max) and ``("flatten", ())``; a weighted layer's shape is its weight's. The torch module
    (:func:`build_model`) and the numpy forward pass (:class:`ArrayModel`) are both made from
    it, so the state dict's keys (the Sequential's indices) are the same for both.

    >>> layer_plan(model_spec("small"))
    (('dense', (16, 64)), ('relu', ()), ('dense', (10, 16)))
    """
    plan: list[tuple[str, tuple[int, ...]]] = []
    width = N_FEATURES
    if spec.kind == "mlp":
        for hidden in spec.widths:
            plan += [("dense", (hidden, width)), ("relu", ())]
            width = hidden
    elif spec.kind == "cnn":
        channels, side = 1, 8
        for index, out in enumerate(spec.widths):
            plan += [("conv", (out, channels, 3, 3)), ("relu", ())]
            if index > 0:
                plan.append(("pool", ()))
                side //= 2
            channels = out
        plan += [("flatten", ()), ("dense", (spec.dense, channels * side * side)), ("relu", ())]
        width = spec.dense
    elif spec.kind != "linear":
        raise FamilyError(f"model {spec.name!r}: unknown kind {spec.kind!r}")
    plan.append(("dense", (N_CLASSES, width)))
    return tuple(plan)


def build_model(spec: ModelSpec) -> nn.Module:
    """An untrained model of ``spec``; it takes raw pixels, shape (n, 64), and returns logits."""
    from torch import nn

    layers: list[nn.Module] = [_pixels_class()(image=spec.kind == "cnn")]
    for kind, shape in layer_plan(spec):
        if kind == "dense":
            layers.append(nn.Linear(shape[1], shape[0]))
        elif kind == "conv":
            layers.append(nn.Conv2d(shape[1], shape[0], kernel_size=3, padding=1))
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "pool":
            layers.append(nn.MaxPool2d(2))
        else:
            layers.append(nn.Flatten())
    return nn.Sequential(*layers)


def parameter_count(model: nn.Module) -> int:
    return sum(int(p.numel()) for p in model.parameters())


@dataclass(frozen=True, slots=True, eq=False)
class DigitsSplit:
    """The fixed split of sklearn's digits: raw pixels (n, 64) as float32, labels as int64."""

    seed: int
    train_inputs: np.ndarray
    train_labels: np.ndarray
    validation_inputs: np.ndarray
    validation_labels: np.ndarray

    def train_sha256(self) -> str:
        return _array_sha256(self.train_inputs, self.train_labels)

    def validation_sha256(self) -> str:
        return _array_sha256(self.validation_inputs, self.validation_labels)

    def describe(self) -> dict[str, Any]:
        return {
            "method": "stratified by label (sklearn train_test_split)",
            "validation_share": VALIDATION_SHARE,
            "train_samples": int(self.train_labels.size),
            "validation_samples": int(self.validation_labels.size),
        }


def load_split(seed: int = SEED) -> DigitsSplit:
    """sklearn's digits split stratified by label, ``VALIDATION_SHARE`` held out, by ``seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    inputs, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        np.asarray(inputs, dtype=np.float32),
        np.asarray(labels, dtype=np.int64),
        test_size=VALIDATION_SHARE,
        stratify=labels,
        random_state=seed,
    )
    return DigitsSplit(
        seed,
        np.ascontiguousarray(x_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(x_val),
        np.ascontiguousarray(y_val),
    )


def default_data_dir() -> Path:
    """``$HETEROPLANE_DATA_DIR``, else ``$XDG_DATA_HOME/heteroplane``, else
    ``~/.local/share/heteroplane`` (the service's data directory, found the same way)."""
    explicit = os.environ.get("HETEROPLANE_DATA_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "heteroplane"


def default_cache_dir() -> Path:
    """Where the family is cached unless told otherwise: ``models`` in :func:`default_data_dir`."""
    return default_data_dir() / "models"


def ensure_family(
    cache_dir: str | Path | None = None,
    *,
    seed: int = SEED,
    progress: ProgressFn | None = None,
) -> Path:
    """Make sure the cache holds the trained family and its validation records; return its path.

    Models whose cached state is missing or does not match (see the module docstring) are trained
    (deterministically, one thread); the validation records are rewritten when any model changed
    or the file is missing or altered.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    say = progress or (lambda _message: None)
    split = load_split(seed)
    manifest = _read_json(directory / MANIFEST_FILE)
    header = _manifest_header(split)
    same_data = manifest is not None and all(manifest.get(k) == v for k, v in header.items())
    entries = _entries_by_name(manifest) if same_data else {}
    stale = [
        spec for spec in FAMILY if not _entry_is_fresh(directory, spec, entries.get(spec.name))
    ]
    validation_entry = manifest.get("validation") if manifest is not None else None
    arrays_written = all(
        _arrays_are_fresh(directory, spec, entries.get(spec.name)) for spec in FAMILY
    )
    if not stale and arrays_written and _file_matches(directory, validation_entry):
        return directory
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    models: dict[str, nn.Module] = {}
    for spec in FAMILY:
        if spec in stale:
            say(f"training {spec.name} ({spec.kind}) on {DATASET}, seed {seed}")
            models[spec.name] = _train(spec, split)
            _write_atomic(directory / f"{spec.name}.pt", _state_bytes(models[spec.name]))
        else:
            models[spec.name] = _load_state(spec, directory)
        _write_atomic(directory / f"{spec.name}{ARRAYS_SUFFIX}", _arrays_bytes(models[spec.name]))
    say(f"writing validation records to {directory / VALIDATION_FILE}")
    with _deterministic_torch():  # the same records whatever the caller's thread count
        document = validation_document(models, split)
    validation_bytes = (json.dumps(document) + "\n").encode()
    _write_atomic(directory / VALIDATION_FILE, validation_bytes)
    accuracy = {entry["name"]: entry["accuracy"] for entry in document["models"]}
    new_manifest = {
        **header,
        "torch_version": torch.__version__,
        "models": [
            {
                "name": spec.name,
                "hyperparameters": spec.hyperparameters(),
                "params": parameter_count(models[spec.name]),
                "accuracy": accuracy[spec.name],
                "file": f"{spec.name}.pt",
                "sha256": _file_sha256(directory / f"{spec.name}.pt"),
                "arrays": {
                    "file": f"{spec.name}{ARRAYS_SUFFIX}",
                    "sha256": _file_sha256(directory / f"{spec.name}{ARRAYS_SUFFIX}"),
                },
            }
            for spec in FAMILY
        ],
        "validation": {
            "file": VALIDATION_FILE,
            "sha256": hashlib.sha256(validation_bytes).hexdigest(),
        },
    }
    _write_atomic(directory / MANIFEST_FILE, (json.dumps(new_manifest, indent=1) + "\n").encode())
    return directory


def load_model(name: str, cache_dir: str | Path | None = None) -> nn.Module:
    """The trained family model ``name`` in eval mode (trained first if the cache lacks it)."""
    spec = model_spec(name)
    directory = ensure_family(cache_dir)
    return _load_state(spec, directory)


# Where export_torchscript writes the family's TorchScript archives, under the model cache.
TORCHSCRIPT_DIR = "torchscript"
# The archive's extra file that gives its inputs' datatypes and shapes (docs/models.md).
SIGNATURE_FILE = "heteroplane/signature.json"


def export_torchscript(name: str, cache_dir: str | Path | None = None) -> Path:
    """The family model ``name`` as a TorchScript archive, as a user would push it to the
    registry: ``<cache>/torchscript/<name>.pt``, traced (the model's forward is plain tensor
    code), with its signature (input ``input``, FP32, shape [-1, 64]; output ``logits``) in the
    archive's extra file :data:`SIGNATURE_FILE`.

    TorchScript archives are not byte-for-byte reproducible, so the archive is written once per
    trained state: a sidecar ``<name>.json`` records the state file's sha256 and the archive's,
    and the archive is written again only when the model was trained again, the signature
    changed or the archive is not the one recorded (damaged, or replaced): the registry then
    gets a new version.
    """
    import torch

    spec = model_spec(name)
    directory = ensure_family(cache_dir)
    state_sha256 = _file_sha256(directory / f"{spec.name}.pt")
    folder = directory / TORCHSCRIPT_DIR
    path = folder / f"{spec.name}.pt"
    sidecar = folder / f"{spec.name}.json"
    # The inputs' datatypes and shapes, and the output's name (FAMILY_SIGNATURE's).
    signature = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, N_FEATURES]}],
        "outputs": [{"name": "logits"}],
    }
    made = {"state_sha256": state_sha256, "signature": signature}
    recorded = _read_json(sidecar)
    if path.is_file() and recorded is not None:
        archive = recorded.pop("archive_sha256", None)
        if recorded == made and archive == _file_sha256(path):
            return path
        if recorded == made and archive is None and _loads(path):
            # A sidecar an older version wrote (no hash): the archive is kept, and its hash
            # recorded, so that the registry does not get a new version of the same model.
            _write_atomic(
                sidecar,
                (json.dumps({**made, "archive_sha256": _file_sha256(path)}) + "\n").encode(),
            )
            return path
    folder.mkdir(parents=True, exist_ok=True)
    model = _load_state(spec, directory)
    with torch.inference_mode(False), torch.no_grad():
        traced = torch.jit.trace(model, torch.zeros((2, N_FEATURES), dtype=torch.float32))  # type: ignore[no-untyped-call]
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer, _extra_files={SIGNATURE_FILE: json.dumps(signature)})
    archive_bytes = buffer.getvalue()
    _write_atomic(path, archive_bytes)
    archive_sha256 = hashlib.sha256(archive_bytes).hexdigest()
    _write_atomic(sidecar, (json.dumps({**made, "archive_sha256": archive_sha256}) + "\n").encode())
    return path


def _loads(path: Path) -> bool:
    """Whether torch loads the TorchScript archive at ``path``."""
    import torch

    try:
        torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception:  # torch's RuntimeError for a damaged archive, or anything else
        return False
    return True


def predict(model: nn.Module, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predicted class and certainty of each input row (raw pixels 0..16, shape (n, 64)).

    certainty = p_(1) - p_(2), the top-1 minus the top-2 softmax score (CascadeServe appendix B,
    eq. 5), in [0, 1]: near 1 when the model is sure, near 0 when two classes are contested.
    """
    import torch

    batch = np.asarray(inputs, dtype=np.float32).reshape(-1, N_FEATURES)
    with torch.inference_mode():
        logits = model(torch.from_numpy(batch))
        top = torch.topk(torch.softmax(logits, dim=1), 2, dim=1)
    scores = top.values.numpy().astype(np.float64)
    predictions = top.indices[:, 0].numpy().astype(np.int64)
    certainty = np.clip(scores[:, 0] - scores[:, 1], 0.0, 1.0)
    return predictions, certainty


def validation_document(models: dict[str, nn.Module], split: DigitsSplit) -> dict[str, Any]:
    """The ``heteroplane.validation/v1`` records of ``models`` (family order) on the split."""
    labels = split.validation_labels
    entries = []
    for spec in FAMILY:
        model = models[spec.name]
        model.eval()
        predictions, certainty = predict(model, split.validation_inputs)
        correct = predictions == labels
        entries.append(
            {
                "name": spec.name,
                "accuracy": float(correct.mean()),
                "predictions": predictions.tolist(),
                "correct": correct.tolist(),
                "certainty": certainty.tolist(),
                "params": parameter_count(model),
            }
        )
    return {
        "format": VALIDATION_FORMAT,
        "dataset": DATASET,
        "seed": split.seed,
        "labels": labels.tolist(),
        "models": entries,
    }


def read_validation(cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The validation records of the cached family (trained first if needed)."""
    directory = ensure_family(cache_dir)
    document: dict[str, Any] = json.loads((directory / VALIDATION_FILE).read_text())
    return document


# --- serving without torch -------------------------------------------------------------------

# Each model's trained state as numpy arrays (``np.savez``, the state dict's keys), written beside
# its state file: what a worker serves the family from, without importing torch.
ARRAYS_SUFFIX = ".npz"


class ArrayModel:
    """A trained family model's forward pass in numpy, from its state dict's arrays: raw pixels
    (n, 64) in, logits (n, 10) out, as the torch module computes them (float32; the same
    predictions on the validation set, logits within 1e-5: tests/unit/test_family.py).

    A worker serves the family this way: importing torch costs a worker process about 3 s of a
    core, and the models are a few matrix products and 3x3 convolutions.
    """

    __slots__ = ("_layers", "spec")

    def __init__(self, spec: ModelSpec, state: dict[str, np.ndarray]) -> None:
        """Raises :class:`FamilyError` when ``state`` lacks a layer's arrays or holds them in
        another shape than ``spec``'s layers have (another model's arrays, say)."""
        self.spec = spec
        # layer_plan's layers in order, each a function of the activations; the state dict's
        # keys are the Sequential's indices (0 is the pixel scaling).
        plain: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            "relu": _relu,
            "pool": _max_pool2,
            "flatten": _flatten,
        }
        layers: list[Callable[[np.ndarray], np.ndarray]] = []
        for index, (kind, shape) in enumerate(layer_plan(spec), start=1):
            if kind in plain:
                layers.append(plain[kind])
                continue
            weight = state.get(f"{index}.weight")
            bias = state.get(f"{index}.bias")
            if weight is None or bias is None or weight.shape != shape or bias.shape != shape[:1]:
                found = "missing" if weight is None or bias is None else list(weight.shape)
                raise FamilyError(
                    f"model {spec.name!r}: layer {index}'s weight is {found}, not {list(shape)}"
                )
            # A dense layer's weight transposed; a convolution's as a (c*9, out) matrix.
            matrix = np.ascontiguousarray(
                np.asarray(weight, dtype=np.float32).reshape(shape[0], -1).T
            )
            layer = _dense if kind == "dense" else _conv3x3
            layers.append(
                functools.partial(layer, matrix=matrix, bias=np.asarray(bias, dtype=np.float32))
            )
        self._layers = tuple(layers)

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        pixels = np.asarray(inputs, dtype=np.float32).reshape(-1, N_FEATURES)
        x = pixels / np.float32(PIXEL_MAX)
        if self.spec.kind == "cnn":
            x = x.reshape(-1, 1, 8, 8)
        for layer in self._layers:
            x = layer(x)
        return np.asarray(x, dtype=np.float32)


def _dense(x: np.ndarray, matrix: np.ndarray, bias: np.ndarray) -> np.ndarray:
    return np.asarray(x @ matrix + bias)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.maximum(x, np.float32(0)))


def _max_pool2(x: np.ndarray) -> np.ndarray:
    n, channels, height, width = x.shape
    return np.asarray(x.reshape(n, channels, height // 2, 2, width // 2, 2).max(axis=(3, 5)))


def _flatten(x: np.ndarray) -> np.ndarray:
    """Images (n, c, h, w) as rows, in (channel, row, column) order as torch's ``Flatten``."""
    return np.asarray(x.reshape(x.shape[0], -1))


def _conv3x3(x: np.ndarray, matrix: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """A 3x3 convolution, stride 1, padding 1, of images (n, c, h, w) with ``matrix`` (c*9, out):
    every pixel's 3x3 neighbourhood as a row, times the matrix."""
    n, channels, height, width = x.shape
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = sliding_window_view(padded, (3, 3), axis=(2, 3))  # n, c, h, w, 3, 3
    rows = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * height * width, channels * 9)
    out = rows @ matrix + bias
    return np.ascontiguousarray(out.reshape(n, height, width, -1).transpose(0, 3, 1, 2))


def load_arrays(
    names: Iterable[str], cache_dir: str | Path | None = None
) -> dict[str, ArrayModel] | None:
    """The family models ``names`` as :class:`ArrayModel` from the cache, without torch or
    scikit-learn, when its manifest vouches for them: this code's format, training revision and
    seed, each model's hyper-parameters as this code has them, and its arrays file unaltered.
    None when it does not (:func:`ensure_family` then trains or writes what is missing).

    Unlike :func:`ensure_family` this does not load the digits again to check that the cache was
    trained on the same data: a worker trusts the manifest the control plane's
    :func:`ensure_family` wrote (the demo, ``heteroplane profile`` and the profiler call it
    before they start workers). Raises :class:`UnknownFamilyModelError` for a name not in the
    family.
    """
    specs = [model_spec(name) for name in names]
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    manifest = _read_json(directory / MANIFEST_FILE)
    if manifest is None or any(
        manifest.get(key) != value
        for key, value in (
            ("format", MANIFEST_FORMAT),
            ("training_revision", TRAINING_REVISION),
            ("seed", SEED),
        )
    ):
        return None
    entries = _entries_by_name(manifest)
    models: dict[str, ArrayModel] = {}
    for spec in specs:
        entry = entries.get(spec.name)
        if (
            entry is None
            or entry.get("hyperparameters") != spec.hyperparameters()
            or not _arrays_are_fresh(directory, spec, entry)
        ):
            return None
        try:
            with np.load(directory / f"{spec.name}{ARRAYS_SUFFIX}", allow_pickle=False) as stored:
                state = {key: stored[key] for key in stored.files}
            models[spec.name] = ArrayModel(spec, state)
        except (OSError, ValueError, FamilyError):  # vouched for by the hash, yet unreadable
            return None
    return models


def _arrays_bytes(model: nn.Module) -> bytes:
    """The model's state dict as an ``.npz`` archive (what ``np.load`` reads), byte for byte the
    same for the same state (a fixed date on every member, where ``np.savez`` stamps the time):
    workers that write the arrays of one cache at once write the same file."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for key, value in model.state_dict().items():
            member = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with archive.open(member, "w") as handle:
                np.lib.format.write_array(handle, value.detach().cpu().numpy(), allow_pickle=False)
    return buffer.getvalue()


# --- training -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _deterministic_torch() -> Iterator[None]:
    """One thread and deterministic kernels while training; the caller's settings come back."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _model_seed(seed: int, name: str) -> int:
    """A seed per (family seed, model): training one model alone gives the same weights."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _train(spec: ModelSpec, split: DigitsSplit) -> nn.Module:
    """Adam on the cross-entropy, minibatches shuffled by a seeded generator, cosine decay."""
    import torch
    from torch.nn import functional

    with _deterministic_torch():
        model_seed = _model_seed(split.seed, spec.name)
        torch.manual_seed(model_seed)
        model = build_model(spec)
        shuffle = torch.Generator().manual_seed(model_seed)
        inputs = torch.from_numpy(split.train_inputs)
        labels = torch.from_numpy(split.train_labels)
        optimizer = torch.optim.Adam(
            model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay
        )
        steps_per_epoch = -(-labels.numel() // spec.batch_size)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=spec.epochs * steps_per_epoch
        )
        model.train()
        for _epoch in range(spec.epochs):
            order = torch.randperm(labels.numel(), generator=shuffle)
            for start in range(0, labels.numel(), spec.batch_size):
                batch = order[start : start + spec.batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = functional.cross_entropy(model(inputs[batch]), labels[batch])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                schedule.step()
        model.eval()
    return model


# --- the cache ----------------------------------------------------------------------------------


def _manifest_header(split: DigitsSplit) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "training_revision": TRAINING_REVISION,
        "dataset": DATASET,
        "seed": split.seed,
        "split": split.describe(),
        "train_data_sha256": split.train_sha256(),
        "validation_data_sha256": split.validation_sha256(),
    }


def _entries_by_name(manifest: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    models = manifest.get("models") if manifest is not None else None
    if not isinstance(models, list):
        return {}
    return {e["name"]: e for e in models if isinstance(e, dict) and isinstance(e.get("name"), str)}


def _arrays_are_fresh(directory: Path, spec: ModelSpec, entry: dict[str, Any] | None) -> bool:
    """Whether the manifest entry names the model's own arrays file, with that file's hash."""
    arrays = entry.get("arrays") if entry is not None else None
    return (
        isinstance(arrays, dict)
        and arrays.get("file") == f"{spec.name}{ARRAYS_SUFFIX}"
        and _file_matches(directory, arrays)
    )


def _entry_is_fresh(directory: Path, spec: ModelSpec, entry: dict[str, Any] | None) -> bool:
    return (
        entry is not None
        and entry.get("hyperparameters") == spec.hyperparameters()
        and entry.get("file") == f"{spec.name}.pt"
        and _file_matches(directory, entry)
    )


def _file_matches(directory: Path, entry: object) -> bool:
    """Whether ``entry`` (``{"file": ..., "sha256": ...}``) names a file there with that hash."""
    if not isinstance(entry, dict):
        return False
    name, digest = entry.get("file"), entry.get("sha256")
    if not isinstance(name, str) or not isinstance(digest, str) or Path(name).name != name:
        return False
    path = directory / name
    return path.is_file() and _file_sha256(path) == digest


def _load_state(spec: ModelSpec, directory: Path) -> nn.Module:
    import torch

    model = build_model(spec)
    state = torch.load(directory / f"{spec.name}.pt", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model


def _state_bytes(model: nn.Module) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and a rename, so a reader never sees half a file."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        # mkstemp makes the file private; a model cache is readable like any data file.
        Path(temporary).chmod(0o644)
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _array_sha256(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(str(array.dtype).encode())
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
