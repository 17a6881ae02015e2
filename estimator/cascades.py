"""Model cascades: validation records, threshold cascades, their quality and their Pareto set.

This module owns what a cascade *is* and how good it is, independent of any fleet:

- :class:`ValidationRecords`, the per-sample outcome of every model of a family on a labelled
  validation set (the ``heteroplane.validation/v1`` document: labels, and per model its
  predictions, whether each was correct and its *certainty*), read by :func:`load_validation`;
- :meth:`ValidationRecords.split` (:func:`split_sample_ids`), the held-out protocol's two
  disjoint, label-stratified halves: *choose*, on which thresholds and gears are chosen, and
  *score*, on which the chosen cascade's accuracy is reported (docs/cascades.md, "The held-out
  protocol");
- :class:`Cascade`, a chain of models, cheapest first, with one threshold per model but the last;
- :func:`evaluate` (accuracy, and the share of queries that reach and that are answered at each
  stage), :func:`forward_flags` (per query, whether it goes on: what the simulator's ``Stage``
  takes), :func:`compute_ms_per_query`, and :func:`pareto_cascades`, the cascades no other beats on
  both accuracy and compute.

The math (CascadeServe, section 4.2, and Cascadia, section 3.3, "threshold-based cascade routing").
A model's certainty on a sample is the top-1 minus the top-2 softmax score, in [0, 1]. A cascade
c = (m_1, ..., m_K) with thresholds (h_1, ..., h_{K-1}) answers sample j at the first stage i
with certainty_{m_i}(j) >= h_i, and at stage K when no earlier one does. With a_i(j) = 1 when
stage i answers j:

    reach_i    = (1/n) sum_j prod_{k<i} [certainty_{m_k}(j) < h_k]      (reach_1 = 1)
    answered_i = (1/n) sum_j a_i(j)
    accuracy   = (1/n) sum_j sum_i a_i(j) correct_{m_i}(j)
    compute    = sum_i reach_i C_{m_i}                                   (ms per query)

reach_i is InferLine's scale factor s_m of stage i. The Pareto set keeps a cascade when no other
has accuracy >= and compute <= with one of them strict (CascadeServe's SP1 output).

Randomness only through an explicit ``numpy.random.Generator`` (:func:`synthetic_validation`,
:func:`with_sample_ids`) or an explicit seed (:func:`split_sample_ids`); the only I/O is
:func:`load_validation` reading the document.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from estimator.errors import CascadeError
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage
from estimator.traces import Trace
from matching.fcfs import FcfsPolicy
from matching.policy import DispatchPolicy

__all__ = [
    "DEFAULT_CHOOSE_SHARE",
    "DEFAULT_SPLIT_SEED",
    "DEFAULT_THRESHOLD_GRID",
    "MAX_CANDIDATES",
    "VALIDATION_FORMAT",
    "Cascade",
    "CascadePoint",
    "CascadeQuality",
    "ValidationRecords",
    "answering_stage",
    "candidate_cascades",
    "cascade_chains",
    "cascade_stages",
    "compute_ms_per_query",
    "evaluate",
    "forward_flags",
    "load_validation",
    "pareto_cascades",
    "pareto_mask",
    "split_sample_ids",
    "synthetic_validation",
    "validation_document",
    "validation_from_document",
    "with_sample_ids",
]

VALIDATION_FORMAT = "heteroplane.validation/v1"
# Thresholds 0.1 .. 0.9: a threshold of 0 would stop every query at that stage (the shorter chain
# without the later models, which the chains already hold) and one above 1 would stop none.
DEFAULT_THRESHOLD_GRID: tuple[float, ...] = tuple(round(0.1 * k, 10) for k in range(1, 10))
# A guard for the Pareto search: chains x grid^(length - 1) candidates are evaluated one by one.
MAX_CANDIDATES = 200_000
# The held-out protocol (docs/cascades.md): half the validation samples choose thresholds and
# gears, the other half score them. Half and half keeps both estimates' standard errors equal.
DEFAULT_CHOOSE_SHARE = 0.5
DEFAULT_SPLIT_SEED = 0
# Certainty is a difference of two softmax scores; float32 rounding may push it a hair past 1.
_CERTAINTY_SLACK = 1e-6

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
ArrayLike1D = Sequence[float] | NDArray[np.float64]


# --- validation records ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class ValidationRecords:
    """Every model's outcome on every validation sample, models cheapest first.

    Arrays are (models, samples): ``predictions`` (int64), ``correct`` (bool), ``certainty``
    (float64 in [0, 1]); ``labels`` has one entry per sample; ``accuracy`` and ``params`` one per
    model. Construction checks shapes and ranges and that ``correct`` is ``predictions ==
    labels``; the arrays become read-only copies.

    >>> records = ValidationRecords(
    ...     dataset="toy", seed=0, labels=np.array([0, 1]), models=("a", "b"),
    ...     predictions=np.array([[0, 0], [0, 1]]), correct=np.array([[1, 0], [1, 1]], bool),
    ...     certainty=np.array([[0.9, 0.2], [0.8, 0.7]]), accuracy=np.array([0.5, 1.0]),
    ...     params=np.array([10, 100]))
    >>> records.n_samples, records.model_index("b")
    (2, 1)
    """

    dataset: str
    seed: int
    labels: IntArray
    models: tuple[str, ...]
    predictions: IntArray
    correct: BoolArray
    certainty: FloatArray
    accuracy: FloatArray
    params: IntArray

    def __post_init__(self) -> None:
        models = tuple(str(m) for m in self.models)
        if not models:
            raise CascadeError("models", "needs at least one model")
        if len(set(models)) != len(models):
            dup = next(m for m in models if models.count(m) > 1)
            raise CascadeError("models", f"model {dup!r} appears twice")
        labels = np.array(self.labels, dtype=np.int64)
        if labels.ndim != 1 or labels.size == 0:
            raise CascadeError("labels", "needs one label per sample, at least one sample")
        shape = (len(models), labels.size)
        arrays: dict[str, Any] = {}
        for name, dtype in (
            ("predictions", np.int64),
            ("correct", np.bool_),
            ("certainty", np.float64),
        ):
            value = np.array(getattr(self, name), dtype=dtype)
            if value.shape != shape:
                raise CascadeError(name, f"has shape {value.shape}, expected {shape}")
            arrays[name] = value
        for name in ("accuracy", "params"):
            value = np.array(getattr(self, name), dtype=np.float64 if name == "accuracy" else None)
            if value.shape != (len(models),):
                raise CascadeError(name, f"needs one value per model, got shape {value.shape}")
            arrays[name] = value
        certainty = arrays["certainty"]
        bad = ~np.isfinite(certainty) | (certainty < 0) | (certainty > 1 + _CERTAINTY_SLACK)
        if bad.any():
            i, j = (int(k) for k in np.argwhere(bad)[0])
            raise CascadeError(
                f"models[{i}].certainty[{j}]", f"must be in [0, 1], got {float(certainty[i, j])!r}"
            )
        arrays["certainty"] = np.minimum(certainty, 1.0)
        mismatch = arrays["correct"] != (arrays["predictions"] == labels[None, :])
        if mismatch.any():
            i, j = (int(k) for k in np.argwhere(mismatch)[0])
            raise CascadeError(
                f"models[{i}].correct[{j}]",
                f"says {bool(arrays['correct'][i, j])} but prediction"
                f" {int(arrays['predictions'][i, j])} vs label {int(labels[j])} says otherwise",
            )
        measured = arrays["correct"].mean(axis=1)
        tolerance = max(1e-3, 0.5 / labels.size)
        for i, (stated, actual) in enumerate(zip(arrays["accuracy"], measured, strict=True)):
            if not abs(float(stated) - float(actual)) <= tolerance:
                raise CascadeError(
                    f"models[{i}].accuracy",
                    f"says {float(stated):.6g} but its correct flags give {float(actual):.6g}",
                )
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "labels", _frozen(labels))
        for name, value in arrays.items():
            object.__setattr__(self, name, _frozen(value))

    @property
    def n_samples(self) -> int:
        return int(self.labels.size)

    def model_index(self, model: str) -> int:
        """The row of ``model``; :class:`CascadeError` naming the known models otherwise."""
        try:
            return self.models.index(model)
        except ValueError:
            raise CascadeError(
                "models", f"no records for model {model!r} (records have: {', '.join(self.models)})"
            ) from None

    def model_accuracy(self, model: str) -> float:
        """The share of samples ``model`` gets right (from the correct flags)."""
        return float(self.correct[self.model_index(model)].mean())

    def subset(self, sample_ids: Sequence[int] | IntArray) -> ValidationRecords:
        """The records of the samples ``sample_ids`` (in that order), each model's accuracy
        recomputed over them.

        Raises:
            CascadeError: no sample, or a sample id outside the records.
        """
        ids = np.asarray(sample_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise CascadeError("sample_ids", "needs at least one sample")
        ids = _samples(self, ids)
        return ValidationRecords(
            dataset=self.dataset,
            seed=self.seed,
            labels=self.labels[ids],
            models=self.models,
            predictions=self.predictions[:, ids],
            correct=self.correct[:, ids],
            certainty=self.certainty[:, ids],
            accuracy=self.correct[:, ids].mean(axis=1),
            params=self.params,
        )

    def split(
        self, share: float = DEFAULT_CHOOSE_SHARE, seed: int = DEFAULT_SPLIT_SEED
    ) -> tuple[ValidationRecords, ValidationRecords]:
        """(choose, score): the held-out protocol's two disjoint halves of the records
        (:func:`split_sample_ids`): thresholds and gears are chosen on ``choose`` and their
        accuracy reported on ``score``, which the choice never saw.

        >>> records = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], n_samples=101)
        >>> choose, score = records.split()
        >>> choose.n_samples, score.n_samples
        (51, 50)
        """
        choose_ids, score_ids = split_sample_ids(self, share, seed)
        return self.subset(choose_ids), self.subset(score_ids)


def split_sample_ids(
    records: ValidationRecords,
    share: float = DEFAULT_CHOOSE_SHARE,
    seed: int = DEFAULT_SPLIT_SEED,
) -> tuple[IntArray, IntArray]:
    """The sample ids of the *choose* and the *score* split (each sorted), disjoint and covering
    every sample; deterministic for (records' labels, ``share``, ``seed``).

    Stratified by label: the samples are ordered by (label, a random rank drawn from
    ``numpy.random.default_rng(seed)``), and the sample at position p of that order goes to
    *choose* when floor((p + 1) s + 1/2) > floor(p s + 1/2), s = ``share`` (systematic sampling
    along the stratified order). So *choose* holds round(n s) samples and every label's count
    in it is within one of its share s of that label's samples; with s = 1/2 the order alternates
    choose, score, choose, ... The records always carry labels (the validation format requires
    them), so there is no unlabelled case to stratify otherwise.

    >>> records = synthetic_validation(np.random.default_rng(0), [0.9], n_samples=10)
    >>> choose, score = split_sample_ids(records, 0.5, seed=3)
    >>> len(choose), len(score), sorted([*choose, *score]) == list(range(10))
    (5, 5, True)

    Raises:
        CascadeError: ``share`` outside (0, 1), or a split that would leave one side empty.
    """
    s = float(share)
    if not (math.isfinite(s) and 0.0 < s < 1.0):
        raise CascadeError("share", f"must be in (0, 1), got {share!r}")
    n = records.n_samples
    rank = np.random.default_rng(seed).permutation(n)
    order = np.lexsort((rank, records.labels))
    position = np.arange(n, dtype=np.float64)
    to_choose = np.floor((position + 1.0) * s + 0.5) > np.floor(position * s + 0.5)
    choose = np.sort(order[to_choose]).astype(np.int64)
    score = np.sort(order[~to_choose]).astype(np.int64)
    if choose.size == 0 or score.size == 0:
        raise CascadeError(
            "share",
            f"a share of {s:g} of {n} sample{'s' if n != 1 else ''} leaves one split empty"
            " (the held-out protocol needs at least one sample on each side)",
        )
    return choose, score


def _frozen(array: NDArray[Any]) -> NDArray[Any]:
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_list(values: object, where: str, source: str | None, n: int | None) -> list[Any]:
    if not isinstance(values, list):
        raise CascadeError(where, f"must be a list, got {type(values).__name__}", source)
    if n is not None and len(values) != n:
        raise CascadeError(
            where, f"has {len(values)} entries, expected {n} (one per label)", source
        )
    return values


def validation_from_document(document: object, source: str | None = None) -> ValidationRecords:
    """Check a parsed ``heteroplane.validation/v1`` document and build the records.

    The document: ``{"format", "dataset", "seed", "labels": [int], "models": [{"name",
    "accuracy", "predictions": [int], "correct": [bool], "certainty": [float], "params"}]}``,
    models cheapest first.

    Raises:
        CascadeError: naming the first offending field (``models[1].certainty[7]``).
    """
    if not isinstance(document, Mapping):
        raise CascadeError("", f"expected a JSON object, got {type(document).__name__}", source)
    fmt = document.get("format", VALIDATION_FORMAT)
    if fmt != VALIDATION_FORMAT:
        raise CascadeError("format", f"expected {VALIDATION_FORMAT!r}, got {fmt!r}", source)
    for key in ("labels", "models"):
        if key not in document:
            raise CascadeError(key, "is required", source)
    dataset = document.get("dataset", "")
    if not isinstance(dataset, str):
        raise CascadeError("dataset", f"must be a text, got {dataset!r}", source)
    seed = document.get("seed", 0)
    if not _whole(seed):
        raise CascadeError("seed", f"must be a whole number, got {seed!r}", source)
    labels = _number_list(document["labels"], "labels", source, None)
    if not labels:
        raise CascadeError("labels", "needs at least one sample", source)
    for j, label in enumerate(labels):
        if not _whole(label):
            raise CascadeError(f"labels[{j}]", f"must be a whole number, got {label!r}", source)
    n = len(labels)
    models_doc = document["models"]
    if not isinstance(models_doc, list) or not models_doc:
        raise CascadeError("models", "must be a non-empty list, cheapest model first", source)
    names: list[str] = []
    predictions, correct, certainty, accuracy, params = [], [], [], [], []
    for i, entry in enumerate(models_doc):
        where = f"models[{i}]"
        if not isinstance(entry, Mapping):
            raise CascadeError(where, "must be an object", source)
        for key in ("name", "accuracy", "predictions", "correct", "certainty"):
            if key not in entry:
                raise CascadeError(f"{where}.{key}", "is required", source)
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise CascadeError(f"{where}.name", f"must be a non-empty text, got {name!r}", source)
        acc = entry["accuracy"]
        if isinstance(acc, bool) or not isinstance(acc, int | float) or not 0 <= acc <= 1:
            raise CascadeError(
                f"{where}.accuracy", f"must be a number in [0, 1], got {acc!r}", source
            )
        count = entry.get("params", 0)
        if not _whole(count) or count < 0:
            raise CascadeError(
                f"{where}.params", f"must be a whole number >= 0, got {count!r}", source
            )
        preds = _number_list(entry["predictions"], f"{where}.predictions", source, n)
        for j, value in enumerate(preds):
            if not _whole(value):
                raise CascadeError(
                    f"{where}.predictions[{j}]", f"must be a whole number, got {value!r}", source
                )
        flags = _number_list(entry["correct"], f"{where}.correct", source, n)
        for j, value in enumerate(flags):
            if not (isinstance(value, bool) or (_whole(value) and value in (0, 1))):
                raise CascadeError(
                    f"{where}.correct[{j}]", f"must be true or false, got {value!r}", source
                )
        certain = _number_list(entry["certainty"], f"{where}.certainty", source, n)
        for j, value in enumerate(certain):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CascadeError(
                    f"{where}.certainty[{j}]", f"must be a number, got {value!r}", source
                )
        names.append(name)
        predictions.append(preds)
        correct.append(flags)
        certainty.append(certain)
        accuracy.append(float(acc))
        params.append(int(count))
    try:
        return ValidationRecords(
            dataset=dataset,
            seed=int(seed),
            labels=np.array(labels, dtype=np.int64),
            models=tuple(names),
            predictions=np.array(predictions, dtype=np.int64),
            correct=np.array(correct, dtype=np.bool_),
            certainty=np.array(certainty, dtype=np.float64),
            accuracy=np.array(accuracy),
            params=np.array(params, dtype=np.int64),
        )
    except CascadeError as error:
        if source is None:
            raise
        raise CascadeError(error.field, error.problem, source) from None
    except OverflowError:  # a label, prediction, seed or count past 64 bits
        raise CascadeError("", "a whole number too large for 64 bits", source) from None


def load_validation(path: str | Path) -> ValidationRecords:
    """Read a ``heteroplane.validation/v1`` JSON file (:func:`validation_from_document`).

    Raises:
        CascadeError: a file that is missing, unreadable, not JSON, or not validation records.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CascadeError("", "no such file", source) from None
    except (OSError, UnicodeDecodeError) as error:
        raise CascadeError("", f"cannot read: {error}", source) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        problem = f"malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        raise CascadeError("", problem, source) from None
    except RecursionError:
        raise CascadeError("", "JSON nested too deeply to read", source) from None
    return validation_from_document(document, source)


def validation_document(records: ValidationRecords) -> dict[str, Any]:
    """The ``heteroplane.validation/v1`` document of ``records`` (the inverse of
    :func:`validation_from_document`)."""
    return {
        "format": VALIDATION_FORMAT,
        "dataset": records.dataset,
        "seed": records.seed,
        "labels": records.labels.tolist(),
        "models": [
            {
                "name": name,
                "accuracy": float(records.accuracy[i]),
                "predictions": records.predictions[i].tolist(),
                "correct": records.correct[i].tolist(),
                "certainty": records.certainty[i].tolist(),
                "params": int(records.params[i]),
            }
            for i, name in enumerate(records.models)
        ],
    }


def synthetic_validation(
    rng: np.random.Generator,
    accuracies: Sequence[float],
    *,
    names: Sequence[str] | None = None,
    n_samples: int = 2000,
    n_classes: int = 10,
    dataset: str = "synthetic",
) -> ValidationRecords:
    """Seeded records of a family whose larger models are right more often, on harder samples.

    Each sample j has a difficulty d_j ~ U(0, 1); model i sees it as d_j + e_ij with
    e_ij ~ N(0, 0.1^2) and is right on the round(a_i n) samples it sees as easiest, so its
    accuracy is a_i and the models' mistakes are correlated, as a real family's are. Certainty
    is a Beta draw: Beta(3, 1.5) when right, Beta(1.3, 2.5) when wrong (confident when right, as
    top-1 minus top-2 of a calibrated classifier tends to be). Wrong predictions are a uniform
    other class.

    >>> records = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], n_samples=500)
    >>> records.models, [round(float(a), 2) for a in records.accuracy]
    (('m0', 'm1'), [0.9, 0.97])
    """
    accuracy = [float(a) for a in accuracies]
    if not accuracy or not all(0.0 < a <= 1.0 for a in accuracy):
        raise CascadeError("accuracies", f"each must be in (0, 1], got {accuracy}")
    if n_samples < 1 or n_classes < 2:
        raise CascadeError(
            "", f"needs n_samples >= 1 and n_classes >= 2 ({n_samples}, {n_classes})"
        )
    model_names = (
        tuple(names) if names is not None else tuple(f"m{i}" for i in range(len(accuracy)))
    )
    if len(model_names) != len(accuracy):
        raise CascadeError("names", "needs one name per accuracy")
    labels = rng.integers(0, n_classes, size=n_samples)
    difficulty = rng.random(n_samples)
    rows_correct = []
    for a in accuracy:
        score = difficulty + rng.normal(0.0, 0.1, size=n_samples)
        # Right on the round(a n) easiest samples by this model's noisy view of difficulty.
        right = np.zeros(n_samples, dtype=bool)
        right[np.argsort(score, kind="stable")[: round(a * n_samples)]] = True
        rows_correct.append(right)
    correct = np.array(rows_correct)
    certainty = np.where(
        correct,
        rng.beta(3.0, 1.5, size=correct.shape),
        rng.beta(1.3, 2.5, size=correct.shape),
    )
    wrong = rng.integers(1, n_classes, size=correct.shape)
    predictions = np.where(correct, labels[None, :], (labels[None, :] + wrong) % n_classes)
    return ValidationRecords(
        dataset=dataset,
        seed=0,
        labels=labels,
        models=model_names,
        predictions=predictions,
        correct=correct,
        certainty=certainty,
        accuracy=correct.mean(axis=1),
        params=np.array([10 ** (3 + i) for i in range(len(accuracy))]),
    )


def with_sample_ids(trace: Trace, records: ValidationRecords, rng: np.random.Generator) -> Trace:
    """``trace`` with each query carrying a validation sample drawn uniformly (with replacement)."""
    sample_id = rng.integers(0, records.n_samples, size=len(trace))
    return Trace(trace.arrival_s, trace.batch_size, sample_id)


# --- cascades --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cascade:
    """A chain of models, cheapest first, and the certainty threshold of every stage but the last.

    A query stops at stage i when its certainty at model i is >= ``thresholds[i]``; the last stage
    always answers. A single model is the cascade ``Cascade(("m",), ())``.

    >>> Cascade(("tiny", "large"), (0.8,)).label
    'tiny@0.8 -> large'
    """

    models: tuple[str, ...]
    thresholds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        models = tuple(self.models)
        thresholds = tuple(float(h) for h in self.thresholds)
        if not models or not all(isinstance(m, str) and m for m in models):
            raise CascadeError("models", f"needs one or more model names, got {models!r}")
        if len(set(models)) != len(models):
            raise CascadeError("models", f"a model appears twice in {models!r}")
        if len(thresholds) != len(models) - 1:
            raise CascadeError(
                "thresholds",
                f"needs one threshold per model but the last ({len(models) - 1}), got"
                f" {len(thresholds)}",
            )
        for i, h in enumerate(thresholds):
            if not (math.isfinite(h) and 0.0 <= h <= 1.0):
                raise CascadeError(f"thresholds[{i}]", f"must be in [0, 1], got {h!r}")
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "thresholds", thresholds)

    @property
    def label(self) -> str:
        """``tiny@0.8 -> small@0.6 -> large``: the chain with each stage's threshold."""
        parts = [f"{m}@{h:g}" for m, h in zip(self.models, self.thresholds, strict=False)]
        return " -> ".join([*parts, self.models[-1]])

    def to_document(self) -> dict[str, Any]:
        return {"models": list(self.models), "thresholds": list(self.thresholds)}


@dataclass(frozen=True, slots=True)
class CascadeQuality:
    """What a cascade does on the validation records: accuracy in [0, 1] and, per stage, the
    share of queries that reach it (reach_share[0] = 1) and that it answers (they sum to 1)."""

    accuracy: float
    reach_share: tuple[float, ...]
    answered_share: tuple[float, ...]


def _samples(records: ValidationRecords, sample_id: IntArray | None) -> IntArray:
    if sample_id is None:
        return np.arange(records.n_samples, dtype=np.int64)
    ids = np.asarray(sample_id, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= records.n_samples):
        bad = int(ids[(ids < 0) | (ids >= records.n_samples)][0])
        raise CascadeError(
            "sample_id",
            f"sample {bad} is not in the validation records (0..{records.n_samples - 1})",
        )
    return ids


def answering_stage(
    cascade: Cascade, records: ValidationRecords, sample_id: IntArray | None = None
) -> IntArray:
    """The stage (0-based) that answers each query: the first i with certainty >= h_i, else the
    last. ``sample_id`` picks the validation sample each query carries (default: every sample
    once, in order).

    >>> records = synthetic_validation(np.random.default_rng(1), [0.8, 0.95], n_samples=4)
    >>> answering_stage(Cascade(records.models, (0.0,)), records).tolist()
    [0, 0, 0, 0]
    """
    ids = _samples(records, sample_id)
    rows = [records.model_index(m) for m in cascade.models]
    stage = np.full(ids.size, len(rows) - 1, dtype=np.int64)
    open_ = np.ones(ids.size, dtype=bool)
    for i, (row, h) in enumerate(zip(rows, cascade.thresholds, strict=False)):
        stops = open_ & (records.certainty[row, ids] >= h)
        stage[stops] = i
        open_ &= ~stops
    return stage


def evaluate(cascade: Cascade, records: ValidationRecords) -> CascadeQuality:
    """Accuracy, reach and answered shares of ``cascade`` on every validation sample (see the
    module docstring for the formulas).

    >>> records = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], n_samples=500)
    >>> evaluate(Cascade(records.models, (1.0,)), records).accuracy == records.model_accuracy("m1")
    True
    """
    stage = answering_stage(cascade, records)
    rows = np.array([records.model_index(m) for m in cascade.models])
    n = records.n_samples
    answered = np.bincount(stage, minlength=len(rows)) / n
    reach = np.concatenate(([1.0], 1.0 - np.cumsum(answered)[:-1]))
    accuracy = float(records.correct[rows[stage], np.arange(n)].mean())
    return CascadeQuality(
        accuracy=accuracy,
        reach_share=tuple(float(max(r, 0.0)) for r in reach),
        answered_share=tuple(float(a) for a in answered),
    )


def forward_flags(
    cascade: Cascade, records: ValidationRecords, sample_id: IntArray
) -> tuple[BoolArray, ...]:
    """Per stage of ``cascade``, per query: whether the query goes on to the next stage (what
    :class:`estimator.simulator.Stage` takes as ``forward``); the last stage's flags are all
    False. ``sample_id[q]`` is the validation sample query q carries (a trace's ``sample_id``).

    Raises:
        CascadeError: a sample id outside the records.
    """
    stage = answering_stage(cascade, records, sample_id)
    return tuple(stage > i for i in range(len(cascade.models)))


def compute_ms_per_query(
    cascade: Cascade, records: ValidationRecords, compute_ms: Mapping[str, float]
) -> float:
    """Expected compute per query, sum_i reach_i C_{m_i}, with C_m the per-query compute of model m
    (e.g. its mean latency at batch 1 on one instance type).

    >>> records = synthetic_validation(np.random.default_rng(0), [0.9, 0.97], n_samples=500)
    >>> compute_ms_per_query(Cascade(records.models, (0.0,)), records, {"m0": 1.0, "m1": 9.0})
    1.0
    """
    quality = evaluate(cascade, records)
    return _compute_ms(cascade, quality.reach_share, compute_ms)


def _compute_ms(cascade: Cascade, reach: Sequence[float], compute_ms: Mapping[str, float]) -> float:
    total = 0.0
    for model, share in zip(cascade.models, reach, strict=True):
        if model not in compute_ms:
            raise CascadeError("compute_ms", f"no compute given for model {model!r}")
        total += share * float(compute_ms[model])
    return total


# --- the Pareto set --------------------------------------------------------------------------


def cascade_chains(models: Sequence[str], max_length: int | None = None) -> list[tuple[str, ...]]:
    """Every non-empty chain of ``models`` that keeps their order (cheapest first): the 2^M - 1
    ordered subsets, shortest first, up to ``max_length`` models.

    >>> cascade_chains(["a", "b", "c"], max_length=2)
    [('a',), ('b',), ('c',), ('a', 'b'), ('a', 'c'), ('b', 'c')]
    """
    longest = len(models) if max_length is None else min(max_length, len(models))
    return [
        tuple(chain) for k in range(1, longest + 1) for chain in itertools.combinations(models, k)
    ]


def candidate_cascades(
    chains: Iterable[Sequence[str]], grid: Sequence[float] = DEFAULT_THRESHOLD_GRID
) -> Iterator[Cascade]:
    """Every chain with every combination of thresholds from ``grid`` at its stages.

    Raises:
        CascadeError: more than :data:`MAX_CANDIDATES` candidates (shorten the grid or chains).
    """
    chosen = [tuple(chain) for chain in chains]
    total = sum(len(grid) ** (len(chain) - 1) for chain in chosen)
    if total > MAX_CANDIDATES:
        raise CascadeError(
            "grid",
            f"{total:,} candidate cascades (more than {MAX_CANDIDATES:,}): use a coarser"
            " threshold grid or shorter chains",
        )
    for chain in chosen:
        for thresholds in itertools.product(grid, repeat=len(chain) - 1):
            yield Cascade(chain, tuple(thresholds))


def pareto_mask(accuracy: ArrayLike1D, cost: ArrayLike1D) -> BoolArray:
    """Which points no other dominates, maximising ``accuracy`` and minimising ``cost``: point p
    is dominated when some q has accuracy_q >= accuracy_p and cost_q <= cost_p with one strict.
    Of identical points the first is kept.

    >>> pareto_mask([0.9, 0.95, 0.93, 0.95], [1.0, 3.0, 3.5, 3.0]).tolist()
    [True, True, False, False]
    """
    acc = np.asarray(accuracy, dtype=np.float64)
    cst = np.asarray(cost, dtype=np.float64)
    order = np.lexsort((-acc, cst))  # cheapest first, most accurate first among equal cost
    keep = np.zeros(acc.size, dtype=bool)
    best = -math.inf
    for k in order:
        if acc[k] > best:
            keep[k] = True
            best = float(acc[k])
    return keep


@dataclass(frozen=True, slots=True)
class CascadePoint:
    """A cascade with its quality and its expected compute per query."""

    cascade: Cascade
    quality: CascadeQuality
    compute_ms_per_query: float


def pareto_cascades(
    records: ValidationRecords,
    compute_ms: Mapping[str, float],
    *,
    models: Sequence[str] | None = None,
    grid: Sequence[float] = DEFAULT_THRESHOLD_GRID,
    max_length: int | None = None,
) -> tuple[CascadePoint, ...]:
    """The Pareto set of cascades (accuracy up, compute per query down) over every ordered chain
    of ``models`` (default: all the records' models, in their order) and every threshold
    combination from ``grid``; sorted by compute, cheapest first (so accuracy rises along it).

    Raises:
        CascadeError: an unknown model, a model without compute, too many candidates.
    """
    names = list(records.models if models is None else models)
    for name in names:
        records.model_index(name)
    points = []
    for cascade in candidate_cascades(cascade_chains(names, max_length), grid):
        quality = evaluate(cascade, records)
        points.append(
            CascadePoint(cascade, quality, _compute_ms(cascade, quality.reach_share, compute_ms))
        )
    keep = pareto_mask(
        np.array([p.quality.accuracy for p in points]),
        np.array([p.compute_ms_per_query for p in points]),
    )
    front = [p for p, kept in zip(points, keep, strict=True) if kept]
    return tuple(sorted(front, key=lambda p: (p.compute_ms_per_query, -p.quality.accuracy)))


# --- cascades in the simulator ---------------------------------------------------------------


def cascade_stages(
    cascade: Cascade,
    records: ValidationRecords,
    sample_id: IntArray | None,
    instances: Mapping[str, Sequence[InstanceSpec]],
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    *,
    max_batch_queries: Mapping[str, int] | int = 1,
    policies: Mapping[str, DispatchPolicy] | None = None,
) -> list[Stage]:
    """The simulator stages of ``cascade``: one per model, each with its own instances and queue,
    ``forward`` from the records and the validation sample each query carries (``sample_id``,
    usually ``trace.sample_id``), so that the simulated reach of stage i is the records' reach
    over the trace's samples and a query's response time spans every stage it visits.

    ``instances[m]`` and ``profiles[m]`` (by instance type) are model m's; ``max_batch_queries``
    is one number for every stage or one per model; ``policies`` (fresh objects: policies keep
    state) default to FCFS.

    Raises:
        CascadeError: a trace without sample ids, a sample id outside the records, a model
            without instances or profiles.
    """
    if sample_id is None:
        raise CascadeError(
            "sample_id",
            "the trace carries no sample ids: a cascade needs to know which validation sample"
            " each query carries (a sample_id column, or with_sample_ids)",
        )
    flags = forward_flags(cascade, records, sample_id)
    stages = []
    for i, model in enumerate(cascade.models):
        if model not in instances or not instances[model]:
            raise CascadeError("instances", f"model {model!r} has no instances")
        if model not in profiles:
            raise CascadeError("profiles", f"model {model!r} has no profiles")
        batch = (
            max_batch_queries
            if isinstance(max_batch_queries, int)
            else max_batch_queries.get(model, 1)
        )
        policy = policies[model] if policies is not None and model in policies else FcfsPolicy()
        last = i + 1 == len(cascade.models)
        stages.append(
            Stage(
                model=model,
                instances=tuple(instances[model]),
                profiles=profiles[model],
                policy=policy,
                max_batch_queries=batch,
                forward=None if last else flags[i],
            )
        )
    return stages
