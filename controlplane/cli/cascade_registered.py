"""``heteroplane cascade evaluate --app APP --data FILE.npz``: validation records of an app's
registered models.

The app's spec comes from the service (``GET /v1/apps/{app}``), each model's artifact bytes too
(``GET /v1/models/{name}/versions/{v}/artifact``, the version the spec is pinned to); each model
then runs here, in process (:func:`provisioners.worker.runtime.load_runtime`), loaded as a worker
loads it: a TorchScript module with the inputs the registry stored for that version (one pushed
with ``--inputs`` names them nowhere in its archive); a model that cannot load here is one line
and exit status 2. They run on the samples of ``FILE.npz`` (array ``inputs``: the samples of the
models' first input, one per row; ``labels``: the class of each). A model's prediction is the
argmax of its first output and its certainty is read off the softmax of that output as the spec
says (``margin``: top-1 minus top-2, CascadeServe's; ``max_prob``: top-1). The records are
written as ``heteroplane.validation/v1`` (:func:`estimator.cascades.validation_document`, as the
demo family's are), cascade order first: what the spec's ``validation`` field names and the
planner reads a cascade's reach shares from.
onnxruntime (or torch) is imported only here, when the command runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from controlplane.cli.client import ApiClient, app_path, client_from
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.profile import check_writable
from controlplane.clients.tensors import read_npz
from estimator.cascades import (
    VALIDATION_FORMAT,
    validation_document,
    validation_from_document,
)
from provisioners.artifacts import ModelSignature, TensorSpec

if TYPE_CHECKING:
    from provisioners.worker.runtime import ModelRuntime

__all__ = [
    "certainty_of",
    "load_data",
    "registered_models",
    "run_evaluate_app",
    "scores_of",
    "validation_records",
]

# Rows per call to a model: bounded memory whatever the data set's size.
_CHUNK_ROWS = 512


def load_data(path: Path, flag: str = "--data") -> tuple[np.ndarray, np.ndarray]:
    """``inputs`` and ``labels`` of an ``.npz`` file (one line of error otherwise, naming the
    option ``flag`` that gave the file)."""
    try:
        arrays = read_npz(path)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except OSError as error:
        raise UsageError(f"{flag} {path}: {error.strerror or error}") from None
    except ValueError as error:  # not an .npz archive, said in one line
        raise UsageError(f"{flag} {path}: {error}") from None
    missing = [name for name in ("inputs", "labels") if name not in arrays]
    if missing:
        raise UsageError(
            f"{flag} {path}: no array {' or '.join(map(repr, missing))}"
            f" (it has: {', '.join(arrays) or 'none'})"
        )
    inputs, labels = arrays["inputs"], arrays["labels"]
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise UsageError(f"{flag} {path}: 'labels' must be one whole number per sample")
    if inputs.ndim < 1 or len(inputs) != len(labels):
        raise UsageError(
            f"{flag} {path}: 'inputs' has {len(inputs) if inputs.ndim else 0} samples,"
            f" 'labels' {len(labels)}"
        )
    if labels.size and labels.min() < 0:
        raise UsageError(
            f"{flag} {path}: 'labels' are class indices (>= 0), got {int(labels.min())}"
        )
    if inputs.dtype.kind in "fc" and not np.isfinite(inputs).all():
        raise UsageError(f"{flag} {path}: 'inputs' hold NaN or infinity; a model is sent numbers")
    if len(labels) == 0:
        raise UsageError(f"{flag} {path}: no samples")
    return inputs, labels.astype(np.int64)


def scores_of(output: np.ndarray) -> np.ndarray:
    """The softmax of each row of a model's first output (flattened past the batch axis)."""
    logits = np.asarray(output, dtype=np.float64).reshape(len(output), -1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    scores: np.ndarray = exp / exp.sum(axis=1, keepdims=True)
    return scores


def certainty_of(scores: np.ndarray, how: str) -> np.ndarray:
    """Per row: ``margin``, the top-1 minus the top-2 score (the top-1 of a single class), or
    ``max_prob``, the top-1 score; in [0, 1].

    >>> certainty_of(np.array([[0.7, 0.2, 0.1]]), "margin").round(3).tolist()
    [0.5]
    >>> certainty_of(np.array([[0.7, 0.2, 0.1]]), "max_prob").round(3).tolist()
    [0.7]
    """
    ordered = np.sort(scores, axis=1)[:, ::-1]
    top1 = ordered[:, 0]
    top2 = ordered[:, 1] if ordered.shape[1] > 1 else np.zeros_like(top1)
    certainty: np.ndarray = np.clip(top1 if how == "max_prob" else top1 - top2, 0.0, 1.0)
    return certainty


def run_evaluate_app(args: argparse.Namespace) -> int:
    if args.data is None:
        raise UsageError("--app needs --data FILE.npz (arrays 'inputs' and 'labels')")
    out: Path = args.out if args.out is not None else Path(f"{args.app}-validation.json")
    check_writable(out)
    inputs, labels = load_data(args.data)
    with client_from(args) as client:
        spec = client.get(app_path(args.app))["spec"]
        models = _registered_models(spec)
        document = validation_records(client, models, inputs, labels, args.data.name)
    entries = document["models"]
    # Checked as the planner will read them, then written as the family's are.
    records = validation_from_document(document, str(out))
    out.write_text(json.dumps(validation_document(records)) + "\n", encoding="utf-8")
    data = {
        "app": args.app,
        "out": str(out),
        "dataset": args.data.name,
        "samples": len(labels),
        "models": [
            {
                "name": entry["name"],
                "artifact": reference,
                "certainty": how,
                "accuracy": entry["accuracy"],
                "mean_certainty": float(np.mean(entry["certainty"])),
            }
            for entry, (_, reference, how) in zip(entries, models, strict=True)
        ],
    }
    return emit(args.json, data, lambda: _human(data))


def validation_records(
    client: ApiClient,
    models: Sequence[tuple[str, str, str]],
    inputs: np.ndarray,
    labels: np.ndarray,
    dataset: str,
    flag: str = "--data",
) -> dict[str, Any]:
    """The ``heteroplane.validation/v1`` document of ``models`` ((name, NAME@VERSION,
    certainty) each, in serving order), each fetched from the service and run here on the
    data (also what ``rollout start --validation-data`` sends, the new version in its place);
    ``flag``: the option the data came from, as errors name it."""
    with tempfile.TemporaryDirectory(prefix="heteroplane-evaluate-") as scratch:
        entries = [
            _evaluate(client, Path(scratch), name, reference, how, inputs, labels, flag)
            for name, reference, how in models
        ]
    return {
        "format": VALIDATION_FORMAT,
        "dataset": dataset,
        "seed": 0,
        "labels": labels.tolist(),
        "models": entries,
    }


def registered_models(spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, NAME@VERSION, certainty) of each model of ``spec`` in serving order."""
    return _registered_models(spec)


def _registered_models(spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(name, NAME@VERSION, certainty) of each model in serving order; every one registered."""
    by_name = {model["name"]: model for model in spec["models"]}
    order: Sequence[str] = spec.get("cascade") or [model["name"] for model in spec["models"]]
    found = []
    for name in order:
        model = by_name[name]
        reference = model.get("artifact")
        if reference is None:
            raise UsageError(
                f"model {name} of app {spec['name']} has no artifact: --app evaluates registered"
                " models (the demo family: heteroplane cascade evaluate without --app)"
            )
        found.append((name, str(reference), str(model.get("certainty", "margin"))))
    return found


def _evaluate(
    client: ApiClient,
    scratch: Path,
    name: str,
    reference: str,
    how: str,
    inputs: np.ndarray,
    labels: np.ndarray,
    flag: str,
) -> dict[str, Any]:
    from provisioners.worker.runtime import first_line

    model, _, version = reference.partition("@")
    quoted = urllib.parse.quote(model, safe="")
    if not version:  # a spec stored before pinning: the latest
        versions = client.get(f"/v1/models/{quoted}")["versions"]
        version = str(max(int(v["version"]) for v in versions))
    document = client.get(f"/v1/models/{quoted}/versions/{version}")
    progress(f"fetching {model} v{version} ({document['format']}) and running it on the data")
    path = scratch / f"{model}-{version}.{'onnx' if document['format'] == 'onnx' else 'pt'}"
    path.write_bytes(client.download(f"/v1/models/{quoted}/versions/{version}/artifact"))
    try:
        runtime = _load(path, document)
    except Exception as error:  # ModelLoadError, a version document's bad inputs, no torch here
        raise UsageError(
            f"model {name} ({model}@{version}) cannot be loaded here: {first_line(error)}"
        ) from None
    batch = _shaped(inputs, runtime.signature, name, flag)
    first_input = runtime.signature.inputs[0].name
    first_output = runtime.signature.outputs[0].name
    try:
        scores = np.concatenate(
            [
                scores_of(runtime.run({first_input: batch[i : i + _CHUNK_ROWS]})[first_output])
                for i in range(0, len(batch), _CHUNK_ROWS)
            ]
        )
    except Exception as error:  # the user's model raised on the user's data: theirs to see
        said = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        raise UsageError(
            f"model {name} ({model}@{version}) failed on the {flag} inputs:"
            f" {type(error).__name__}: {said}"
        ) from None
    classes = scores.shape[1] if scores.ndim == 2 else 1
    if labels.max() >= classes:
        raise UsageError(
            f"{flag} 'labels' go up to {int(labels.max())}; model {name} answers {classes}"
            f" classes (0..{classes - 1})"
        )
    predictions = scores.argmax(axis=1).astype(np.int64)
    correct = predictions == labels
    return {
        "name": name,
        "accuracy": float(correct.mean()),
        "predictions": predictions.tolist(),
        "correct": correct.tolist(),
        "certainty": certainty_of(scores, how).tolist(),
        "params": 0,  # not known for a registered artifact
    }


def _load(path: Path, document: Mapping[str, Any]) -> ModelRuntime:
    """The version at ``path`` loaded as a worker loads it (``ModelVersionRecord.ref``): a
    TorchScript module with the inputs its version document holds, what the registry stored at
    push (from ``--inputs``, or the archive's signature file), since the archive of a module
    pushed with ``--inputs`` holds no input shapes; an ONNX model with its graph's own."""
    from provisioners.worker.runtime import load_runtime

    if document["format"] != "torchscript":
        return load_runtime(path, document["format"])
    inputs = tuple(TensorSpec.from_json(spec) for spec in document["inputs"])
    return load_runtime(path, "torchscript", inputs=inputs)


def _shaped(inputs: np.ndarray, signature: ModelSignature, name: str, flag: str) -> np.ndarray:
    """``inputs`` as a batch of the model's single input: its samples' shape (reshaped from flat
    rows when the sizes agree) and type."""
    if len(signature.inputs) != 1:
        raise UsageError(
            f"model {name} takes {len(signature.inputs)} inputs; {flag} holds one array"
            " ('inputs'), so only models of one input are evaluated"
        )
    tensor = signature.inputs[0]
    sample = tensor.sample_shape
    given = inputs.shape[1:]
    fits = len(given) == len(sample) and all(
        d in (-1, g) for d, g in zip(sample, given, strict=True)
    )
    if not fits:
        if -1 in sample or int(np.prod(given)) != int(np.prod(sample)):
            raise UsageError(
                f"{flag} 'inputs' samples are {list(given)}; model {name}'s input"
                f" {tensor.name} takes {list(sample)} ({tensor.datatype})"
            )
        inputs = inputs.reshape(len(inputs), *sample)
    return np.ascontiguousarray(inputs, dtype=tensor.dtype)


def _human(data: Mapping[str, Any]) -> str:
    lines = [
        f"wrote {data['out']}: validation records of {data['app']}'s models on"
        f" {data['dataset']} ({data['samples']} samples)"
    ]
    for model in data["models"]:
        lines.append(
            f"  {model['name']} ({model['artifact']}): accuracy {model['accuracy'] * 100:.2f}%,"
            f" mean certainty ({model['certainty']}) {model['mean_certainty']:.3f}"
        )
    lines.append(
        f"name it in the spec (validation: {data['out']}) with the cascade's thresholds; the"
        " service reads files in its data directory only: write it there (--out) or copy it"
        " there (docs/app-spec.md)"
    )
    return "\n".join(lines)
