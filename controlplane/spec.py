"""The app spec: the document a user hands in to say what to serve, under which SLO and budget.

This module owns the spec's schema (:class:`AppSpec` with :class:`ModelSpec` and :class:`SLOSpec`,
pydantic models: the spec is a trust boundary, and the API accepts the same document), reading it
from a YAML or JSON file (:func:`load_spec`), and checking it against the data it names
(:func:`resolve_spec`: the instance catalog and the latency profiles), which yields a
:class:`ResolvedApp`, and the limits every planner and scaler holds to, read from the spec in one
place (:class:`PlanningConstraints`, ``ResolvedApp.constraints``). The contract is DESIGN.md
section 4; every field is described in ``docs/app-spec.md``.

Every problem is one :class:`SpecError` whose ``field`` is the path of the offending value
(``slo.percentile``, ``models[1].name``, ``max_counts[g4dn.xlarge]``) and whose message is the one
line ``field: problem`` (prefixed with the file when one was read).

>>> spec = AppSpec.model_validate({
...     "name": "recs",
...     "models": [{"name": "rm2", "profiles": "profiles.csv"}],
...     "slo": {"latency_ms": 350},
...     "budget_usd_per_hr": 10,
...     "instance_types": ["g4dn.xlarge", "r5n.large"],
... })
>>> spec.slo.percentile, spec.model_names
(99.0, ['rm2'])
>>> validate_spec({"name": "recs", "models": [], "slo": {"latency_ms": 350},
...                "budget_usd_per_hr": -1, "instance_types": ["t3.xlarge"]})
Traceback (most recent call last):
...
controlplane.spec.SpecError: models: must hold at least 1 item, got []
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from controlplane.errors import shown
from estimator.documents import DuplicateKeyError, UniqueKeyLoader, loads_json
from estimator.errors import (
    EstimatorError,
    MissingProfileError,
    UnknownInstanceTypeError,
    UnknownModelError,
)
from estimator.fleet import MAX_FLEET_INSTANCES
from estimator.numbers import plain

if TYPE_CHECKING:
    # Resolving a spec reads its data with these; reading and checking one (what the command
    # line's client commands do) needs none of them, and they import numba (about 0.4 s).
    from estimator.cascades import Cascade, ValidationRecords
    from estimator.catalog import Catalog
    from estimator.profiles import LatencyProfile, ProfileSet

__all__ = [
    "MAX_BUDGET_USD_PER_HR",
    "MAX_SLO_LATENCY_MS",
    "MIN_BUDGET_USD_PER_HR",
    "AppSpec",
    "ModelSpec",
    "PlanningConstraints",
    "ResolvedApp",
    "ResolvedArtifact",
    "SLOSpec",
    "SpecError",
    "SpecMissingProfileError",
    "SpecUnknownInstanceTypeError",
    "SpecUnknownModelError",
    "SpotSpec",
    "UnprofiledModelError",
    "anchor_paths",
    "check_budget_buys_one",
    "check_slo_reachable",
    "confine_paths",
    "load_spec",
    "lowest_prices",
    "parse_artifact",
    "resolve_spec",
    "spec_error_from",
    "validate_spec",
    "whole_number",
]

# An app's name is used in instance tags, metric labels and URLs, so it is held to a DNS label
# (RFC 1123): lowercase letters, digits and '-', not starting or ending with '-', at most 63.
_APP_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"
_APP_NAME_MAX = 63


def parse_artifact(text: str) -> tuple[str, int | None]:
    """A model spec's ``artifact``, ``NAME`` or ``NAME@VERSION``, as (name, version), version
    ``None`` for the latest; :class:`SpecError` (no field: the caller names it) when it is
    neither. A registry name is a DNS label, as an app's name is.

    >>> parse_artifact("digits@3"), parse_artifact("digits")
    (('digits', 3), ('digits', None))
    """
    name, at, version = text.partition("@")
    # fullmatch: "$" also matches before a trailing newline.
    if not re.fullmatch(_APP_NAME_PATTERN, name) or len(name) > _APP_NAME_MAX:
        raise SpecError(
            "",
            f"{text!r} is not NAME or NAME@VERSION (a name is lowercase letters, digits and '-',"
            f" at most {_APP_NAME_MAX})",
        )
    if not at:
        return name, None
    if not version.isascii() or not version.isdigit() or int(version) < 1:
        raise SpecError("", f"{text!r}: the version after '@' must be a whole number >= 1")
    if len(version) > _VERSION_DIGITS:
        raise SpecError("", f"{text!r}: the version after '@' has at most {_VERSION_DIGITS} digits")
    return name, int(version)


# The most digits of a registry version (versions count pushes: 1, 2, 3, ...).
_VERSION_DIGITS = 9


# --- errors ----------------------------------------------------------------------------------


# A path the OS can look up: no NUL byte (open() and realpath() raise ValueError on one).
_PATH_PATTERN = r"^[^\x00]*$"
# The largest budget a spec (and the budget route) accepts: a million dollars an hour is past any
# fleet this plans, and a bound keeps counts = budget / price far from integer overflow.
MAX_BUDGET_USD_PER_HR = 1e6
# The least budget (a hundredth of a cent an hour): costs are compared with budgets allowing
# 1e-9 USD/hr of float rounding, at most a hundred-thousandth of a budget this size.
MIN_BUDGET_USD_PER_HR = 1e-4
# The largest latency target an SLO may set: a day (a bound above it is a typo; the infer
# route's requirements.latency_ms has the same bound).
MAX_SLO_LATENCY_MS = 86_400_000.0


class SpecError(EstimatorError):
    """An app spec that is malformed or does not fit the data it names.

    ``field`` is the path of the offending value (``slo.percentile``, ``models[1].name``; empty for
    the document as a whole), ``problem`` what is wrong with it, ``source`` the file read (if any).
    The message is the one line ``source: field: problem``.
    """

    def __init__(self, field: str, problem: str, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        parts = [part for part in (source, field, problem) if part]
        # Called by name, not through super(): the subclasses below also derive from another
        # EstimatorError whose __init__ takes other arguments.
        EstimatorError.__init__(self, ": ".join(parts))


class SpecUnknownInstanceTypeError(SpecError, UnknownInstanceTypeError):
    """A candidate instance type that the catalog does not know (field ``instance_types[i]``)."""

    def __init__(
        self, field: str, instance_type: str, known: list[str], source: str | None = None
    ) -> None:
        UnknownInstanceTypeError.__init__(self, instance_type, known)
        SpecError.__init__(self, field, str(self.args[0]), source)


class SpecUnknownModelError(SpecError, UnknownModelError):
    """A model that its profile file has no measurements for (field ``models[i].name``)."""

    def __init__(
        self, field: str, model: str, known: list[str], profiles: str, source: str | None = None
    ) -> None:
        UnknownModelError.__init__(self, model, known)
        problem = f"model {model!r} is not in {profiles} (it has: {', '.join(self.known)})"
        SpecError.__init__(self, field, problem, source)


class UnprofiledModelError(UnknownModelError):
    """A registered model (an ``artifact``) of an app whose latency profiles have not been
    measured yet: an :class:`UnknownModelError` (callers that read it so behave the same) that
    says what to do instead of "unknown model"."""

    def __init__(self, app: str, model: str, known: list[str]) -> None:
        super().__init__(model, known)
        self.app = app
        self.args = (
            f"app {app} has no latency profiles for model {model} yet: run heteroplane profile"
            f" run --app {app}",
        )


class SpecMissingProfileError(SpecError, MissingProfileError):
    """A candidate instance type that a model's profile file has no measurements for."""

    def __init__(
        self, field: str, model: str, instance_type: str, profiles: str, source: str | None = None
    ) -> None:
        MissingProfileError.__init__(self, model, instance_type)
        problem = (
            f"missing profile for candidate type {instance_type!r} of model {model!r} in {profiles}"
        )
        SpecError.__init__(self, field, problem, source)


# --- the schema ------------------------------------------------------------------------------

# extra="forbid": a misspelt key is an error naming it, not a silently ignored setting.
# strict=True: "10" is not a budget and true is not a count; ints are accepted where floats are.
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


def whole_number(value: object) -> object:
    """JSON has one number type, and JSON Schema's ``integer`` is any number with a zero
    fractional part: 7.0 is the integer 7 (and 7.5 stays a float, which strict mode refuses)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class ModelSpec(BaseModel):
    """One model of the app: where its latency profiles are, the registered artifact that
    serves it, or both; and how its certainty is read (cascades)."""

    model_config = _STRICT

    name: str = Field(min_length=1, description="the model's name as the profile file spells it")
    profiles: str | None = Field(
        default=None,
        min_length=1,
        pattern=_PATH_PATTERN,
        description="Kairos samples CSV (.csv or .csv.gz) or the project's profile JSON; a"
        " relative path resolves against the spec file's folder. Left out for an artifact"
        " model: the service measures them (heteroplane profile run)",
    )
    artifact: str | None = Field(
        default=None,
        min_length=1,
        description="a model of the service's registry that serves this model: NAME (pinned to"
        " its latest version when the app is registered) or NAME@VERSION",
    )
    certainty: Literal["margin", "max_prob"] = Field(
        default="margin",
        description="how a cascade reads a stage's certainty off the model's first output:"
        " margin (top-1 minus top-2 of its softmax) or max_prob (top-1 of its softmax)",
    )
    memory_mb: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="memory the model takes on an instance, MB (GPU memory on a GPU type, host"
        " memory otherwise): what the cascade placement packs (docs/cascades.md, SP3). Left"
        " out: twice its registered artifact's size, else 64 MB (a demo family model)",
    )

    @property
    def artifact_ref(self) -> tuple[str, int | None] | None:
        """``artifact`` as (registry name, version or None for the latest); None without one."""
        return None if self.artifact is None else parse_artifact(self.artifact)


class SLOSpec(BaseModel):
    """The service-level objective: a latency percentile, and for cascades an accuracy floor."""

    model_config = _STRICT

    latency_ms: float = Field(
        gt=0,
        le=MAX_SLO_LATENCY_MS,
        allow_inf_nan=False,
        description="latency target, ms (at most a day)",
    )
    percentile: float = Field(
        default=99.0, gt=0, lt=100, description="share of queries (in %) within latency_ms"
    )
    accuracy: float | None = Field(
        default=None, gt=0, le=1, description="accuracy floor in (0, 1] (cascades)"
    )


class SpotSpec(BaseModel):
    """How much of the fleet may run on spot, and how much must survive losing all of it."""

    model_config = _STRICT

    enabled: bool = Field(default=False, description="plan spot capacity (docs/spot.md)")
    max_share: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="the most of a stage's planned capacity (its instances' throughput) spot may"
        " hold, in [0, 1]",
    )
    survive_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="the share of the capacity the load needs that must remain if every spot"
        " instance is lost at once (the on-demand base), in [0, 1]",
    )


class PlanningSpec(BaseModel):
    """How the planner searches (docs/planner.md)."""

    model_config = _STRICT

    trades: bool = Field(
        default=False,
        description="after Algorithm 2's cuts, also trade several instances of one type for one"
        ' of another (docs/planner.md, "Trades after the cuts"): cheaper plans, several times'
        " the planning time",
    )


class AppSpec(BaseModel):
    """An app: what to serve (models, cascade order), the SLO, the budget and the candidate types.

    Checks that involve several fields (unique names, the cascade order against the models, the
    max counts against the candidate types) raise :class:`SpecError` naming the field; pydantic
    carries it inside its ``ValidationError``, and :func:`spec_error_from` takes it out again.
    """

    model_config = _STRICT

    name: str = Field(pattern=_APP_NAME_PATTERN, max_length=_APP_NAME_MAX)
    models: list[ModelSpec] = Field(min_length=1)
    cascade: list[str] | None = None
    thresholds: list[float] | None = Field(
        default=None,
        description="cascade certainty thresholds in [0, 1], one per model but the last: a query"
        " stops at the first stage whose certainty (top-1 minus top-2 score) reaches it",
    )
    validation: str | None = Field(
        default=None,
        min_length=1,
        pattern=_PATH_PATTERN,
        description="validation records (heteroplane.validation/v1) of the cascade's models: the"
        " share of queries reaching each stage (its scale factor) comes from them",
    )
    slo: SLOSpec
    budget_usd_per_hr: float = Field(
        ge=MIN_BUDGET_USD_PER_HR, le=MAX_BUDGET_USD_PER_HR, allow_inf_nan=False
    )
    # The item bounds are in the schema (the OpenAPI document's too), not only in a check.
    instance_types: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    # The bound before the validator: pydantic leaves constraints that follow a BeforeValidator
    # out of the JSON Schema.
    # At most a fleet's most instances (estimator.fleet.MAX_FLEET_INSTANCES), which nothing could
    # simulate or run past.
    max_counts: (
        dict[
            str,
            Annotated[int, Field(ge=0, le=MAX_FLEET_INSTANCES), BeforeValidator(whole_number)],
        ]
        | None
    ) = None
    catalog: str | None = Field(default=None, min_length=1, pattern=_PATH_PATTERN)
    scaling: Literal["inferline", "infaas"] = Field(
        default="inferline",
        description="who scales the running fleet: inferline (InferLine's tuner on the plan's"
        " envelope, docs/tuner.md) or infaas (INFaaS's model- and VM-level autoscaler on the"
        " serving loop's Active/Overloaded/Interfered/Inactive states, docs/serving.md)",
    )
    spot: SpotSpec | None = Field(
        default=None,
        description="spot capacity in the plan: enabled, max_share, survive_share (docs/spot.md);"
        " left out: on demand only",
    )

    planning: PlanningSpec | None = Field(
        default=None,
        description="how the planner searches: trades (docs/planner.md); left out: its defaults",
    )

    @model_validator(mode="after")
    def _check_fields_together(self) -> AppSpec:
        _check_unique(self.model_names, "models[{}].name", "model")
        for i, model in enumerate(self.models):
            if model.profiles is None and model.artifact is None:
                raise SpecError(
                    f"models[{i}]",
                    "needs profiles (a profile file), artifact (a model of the registry), or both",
                )
            if model.artifact is not None:
                try:
                    parse_artifact(model.artifact)
                except SpecError as error:
                    raise SpecError(f"models[{i}].artifact", error.problem) from None
        _check_cascade(self.model_names, self.cascade)
        _check_thresholds(self.cascade, self.thresholds, self.validation)
        _check_unique(self.instance_types, "instance_types[{}]", "instance type")
        for name in self.max_counts or {}:
            if name not in self.instance_types:
                raise SpecError(
                    f"max_counts{_key(name)}",
                    f"{name!r} is not one of instance_types ({', '.join(self.instance_types)})",
                )
        caps = self.max_counts or {}
        if self.instance_types and all(caps.get(t) == 0 for t in self.instance_types):
            # Like a budget that buys no instance: the app could run none (a tester's spec was
            # taken, and the app ran on the one instance the drain guard keeps).
            raise SpecError(
                "max_counts",
                f"allows no instance of any candidate type ({', '.join(self.instance_types)}):"
                " the app could run none; leave one type uncapped or above 0",
            )
        return self

    @property
    def model_names(self) -> list[str]:
        """The models' names, in the order given."""
        return [model.name for model in self.models]

    @property
    def serving_order(self) -> list[str]:
        """The models in the order a query visits them: the cascade, or the single model."""
        return list(self.cascade) if self.cascade is not None else self.model_names

    @property
    def spot_enabled(self) -> bool:
        """Whether the app plans spot capacity."""
        return self.spot is not None and self.spot.enabled

    def max_count(self, instance_type: str) -> int | None:
        """The most instances of ``instance_type`` the app may run (``None``: no cap)."""
        return (self.max_counts or {}).get(instance_type)


def lowest_prices(spec: AppSpec, catalog: Catalog, *, measuring: bool = False) -> dict[str, float]:
    """The least an instance of each candidate type can cost under ``spec``: its spot price
    (the catalog's) where one instance of it may be all spot (spot on, ``survive_share`` 0,
    ``max_share`` 1: a plan of one instance per stage keeps no on-demand base), else its
    on-demand price; on-demand prices when ``measuring`` (a model still to be profiled: the
    profile run's workers run on demand)."""
    spot = spec.spot if spec.spot_enabled and not measuring else None
    all_spot = spot is not None and spot.survive_share == 0 and spot.max_share >= 1
    prices = {}
    for name in spec.instance_types:
        price = catalog.price_usd_per_hr(name)
        spot_price = catalog[name].spot_price_usd_per_hr
        prices[name] = min(price, spot_price) if all_spot and spot_price is not None else price
    return prices


def check_budget_buys_one(spec: AppSpec, catalog: Catalog, *, measuring: bool = False) -> None:
    """:class:`SpecError` when the budget buys no instance of any candidate type, at the
    least it can cost (:func:`lowest_prices`: a spot price where the app may run all spot and
    no model is still to be ``measuring``)."""
    prices = lowest_prices(spec, catalog, measuring=measuring)
    cheapest = min(prices, key=lambda name: prices[name])
    if prices[cheapest] > spec.budget_usd_per_hr:
        how = "on spot " if prices[cheapest] < catalog.price_usd_per_hr(cheapest) else ""
        raise SpecError(
            "budget_usd_per_hr",
            f"{plain(spec.budget_usd_per_hr)} USD/hr buys no instance: the cheapest candidate,"
            f" {cheapest}, costs {how}{plain(prices[cheapest])} USD/hr",
        )


def _check_unique(names: Sequence[str], field: str, what: str) -> None:
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise SpecError(
                field.format(i), f"{what} {name!r} appears twice (first at index {first[name]})"
            )
        first[name] = i


def _check_thresholds(
    cascade: list[str] | None, thresholds: list[float] | None, validation: str | None
) -> None:
    for field, given in (("thresholds", thresholds is not None), ("validation", validation)):
        if given and cascade is None:
            raise SpecError(field, "applies to a cascade only; name the cascade order first")
    if thresholds is None or cascade is None:
        if validation is not None and thresholds is None:
            raise SpecError("thresholds", "validation records need the cascade's thresholds")
        return
    if len(thresholds) != len(cascade) - 1:
        raise SpecError(
            "thresholds",
            f"needs one threshold per model but the last ({len(cascade) - 1}), got"
            f" {len(thresholds)}",
        )
    for i, threshold in enumerate(thresholds):
        if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
            raise SpecError(f"thresholds[{i}]", f"must be in [0, 1], got {threshold!r}")


def _check_cascade(models: list[str], cascade: list[str] | None) -> None:
    if cascade is None:
        if len(models) > 1:
            raise SpecError(
                "cascade",
                "several models need a cascade order, cheapest first"
                f" (models: {', '.join(models)})",
            )
        return
    if len(models) < 2:
        raise SpecError("cascade", f"a cascade needs at least two models, got {len(models)}")
    _check_unique(cascade, "cascade[{}]", "model")
    for i, name in enumerate(cascade):
        if name not in models:
            raise SpecError(
                f"cascade[{i}]", f"{name!r} is not one of the models ({', '.join(models)})"
            )
    left_out = [name for name in models if name not in cascade]
    if left_out:
        raise SpecError(
            "cascade", f"must list every model once; it leaves out {', '.join(left_out)}"
        )


# --- pydantic errors as one line -------------------------------------------------------------

_FIELDS_AT: dict[tuple[str, ...], type[BaseModel]] = {
    (): AppSpec,
    ("models",): ModelSpec,
    ("slo",): SLOSpec,
    ("spot",): SpotSpec,
}

_KINDS = {
    "float_type": "a number",
    "int_type": "a whole number",
    "string_type": "text",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "bool_type": "true or false",
}


def spec_error_from(error: ValidationError, source: str | None = None) -> SpecError:
    """The first problem of a pydantic ``ValidationError`` (an unknown field before the others)
    as a :class:`SpecError`."""
    details = error.errors(include_url=False)
    # An unknown field first: a misspelt key also makes the real one "required", and the
    # misspelling is the useful thing to point at.
    detail = next((d for d in details if d["type"] == "extra_forbidden"), details[0])
    loc: tuple[int | str, ...] = tuple(detail["loc"])
    context: dict[str, Any] = detail.get("ctx") or {}
    cause = context.get("error")
    if isinstance(cause, SpecError):
        # A check of several fields together: it already names its field.
        return SpecError(cause.field, cause.problem, source)
    return SpecError(_field_path(loc), _problem(detail["type"], detail, loc), source)


# Fields that map names to values: a key of theirs is shown as [name], never as .name.
_MAPPING_FIELDS = frozenset({"max_counts"})


def _field_path(loc: Sequence[int | str]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":
            continue
        elif path and (not part.isidentifier() or path in _MAPPING_FIELDS):
            path += _key(part)
        else:
            path += f".{part}" if path else part
    return path


def _key(name: str) -> str:
    return f"[{name}]"


def _problem(kind: str, detail: Mapping[str, Any], loc: Sequence[int | str]) -> str:
    context: dict[str, Any] = detail.get("ctx") or {}
    got = shown(detail.get("input"))
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        parent = tuple(part for part in loc[:-1] if isinstance(part, str))
        model = _FIELDS_AT.get(parent)
        allowed = f" (allowed: {', '.join(model.model_fields)})" if model is not None else ""
        return f"unknown field{allowed}"
    if kind in _KINDS:
        return f"must be {_KINDS[kind]}, got {got}"
    bounds = {
        "greater_than": ">",
        "greater_than_equal": ">=",
        "less_than": "<",
        "less_than_equal": "<=",
    }
    for bound, sign in bounds.items():
        if kind == bound:
            limit = next(iter(context.values()))
            bound_text = f"{limit:g}" if isinstance(limit, int | float) else str(limit)
            return f"must be {sign} {bound_text}, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind == "string_pattern_mismatch" and context.get("pattern") == _PATH_PATTERN:
        return "must be a path without NUL bytes"
    if kind == "string_pattern_mismatch":
        return (
            f"must be lowercase letters, digits and '-' (not first or last), got {got}"
            if tuple(loc) == ("name",)
            else f"must match {context.get('pattern')}, got {got}"
        )
    if kind in ("too_short", "string_too_short"):
        what = "item" if kind == "too_short" else "character"
        least = context.get("min_length", 1)
        return f"must hold at least {least} {what}{'s' if least != 1 else ''}, got {got}"
    if kind in ("too_long", "string_too_long"):
        what = "items" if kind == "too_long" else "characters"
        return f"must hold at most {context.get('max_length')} {what}, got {got}"
    message = str(detail.get("msg", kind))
    return f"{message[:1].lower()}{message[1:]}, got {got}"


def validate_spec(document: object, source: str | None = None) -> AppSpec:
    """Validate a parsed document (a mapping from YAML, JSON or an API body) as an app spec.

    Unlike ``AppSpec.model_validate``, a problem is a :class:`SpecError` naming the field.
    """
    if not isinstance(document, Mapping):
        kind = "empty" if document is None else type(document).__name__
        raise SpecError("", f"an app spec is a mapping of fields, got {kind}", source)
    try:
        return AppSpec.model_validate(dict(document))
    except ValidationError as error:
        raise spec_error_from(error, source) from None


# --- reading a file --------------------------------------------------------------------------


class _UniqueKeyLoader(UniqueKeyLoader):
    """:class:`~estimator.documents.UniqueKeyLoader` (a key given twice is refused) that reads
    YAML 1.2's floats too (below)."""


# YAML 1.2's floats with an exponent and no dot or sign in it (1e9, 350.5e0, 2E-3), which
# PyYAML's YAML 1.1 rules read as strings: "latency_ms: 1e9" would be refused as not a number.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_document(text: str, source: str, as_json: bool) -> object:
    if as_json:
        try:
            return loads_json(text)
        except DuplicateKeyError as error:
            raise SpecError("", f"malformed JSON: {error}", source) from None
        except json.JSONDecodeError as error:
            raise SpecError(
                "",
                f"malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}",
                source,
            ) from None
        except RecursionError:
            raise SpecError("", "JSON nested too deeply to read", source) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except RecursionError:
        raise SpecError("", "YAML nested too deeply to read", source) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SpecError("", f"malformed YAML{where}: {problem}", source) from None


# The largest spec file read: the API's body limit (an app spec is sent to it whole), far past
# any real one (a spec of 200 models is about 8 kB).
MAX_SPEC_BYTES = 1 << 20


def load_spec(path: str | Path) -> AppSpec:
    """Read, validate and anchor an app spec file (YAML, or JSON).

    Relative ``profiles`` and ``catalog`` paths are resolved against the spec file's folder, so
    the returned spec names absolute paths and can be used from any working directory.
    """
    path = Path(path)
    source = str(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError("", "no such file", source) from None
    except OSError as error:
        raise SpecError("", f"cannot read: {error.strerror or error}", source) from None
    if len(raw) > MAX_SPEC_BYTES:
        # Refused before parsing: 7.5 MB of YAML took a minute to be refused for a missing field.
        raise SpecError("", f"larger than {MAX_SPEC_BYTES:,} bytes: not an app spec", source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("", "not a text file (expected YAML or JSON)", source) from None
    # JSON is read as JSON: PyYAML (YAML 1.1) refuses some valid JSON, such as tab indentation.
    as_json = path.suffix.lower() == ".json" or text.lstrip().startswith("{")
    spec = validate_spec(_parse_document(text, source, as_json), source)
    return anchor_paths(spec, path.resolve().parent)


def anchor_paths(spec: AppSpec, base_dir: str | Path) -> AppSpec:
    """``spec`` with its relative ``profiles`` and ``catalog`` paths made absolute under
    ``base_dir`` (``~`` expanded); absolute paths are kept."""
    base = Path(base_dir)

    def anchored(text: str) -> str:
        candidate = Path(text).expanduser()
        return str(candidate if candidate.is_absolute() else (base / candidate).resolve())

    models = [
        model.model_copy(update={"profiles": anchored(model.profiles)})
        if model.profiles is not None
        else model
        for model in spec.models
    ]
    catalog = anchored(spec.catalog) if spec.catalog is not None else None
    validation = anchored(spec.validation) if spec.validation is not None else None
    return spec.model_copy(update={"models": models, "catalog": catalog, "validation": validation})


def confine_paths(spec: AppSpec, root: str | Path) -> None:
    """Refuse a spec (from the API) whose ``profiles``, ``catalog`` or ``validation`` path leads
    outside ``root`` (the service's data directory, which holds its uploads), relative paths
    taken under it, ``..`` and links followed: :class:`SpecError` naming the field.

    The message is made of the path as sent, its plain join with the data directory (``..``
    collapsed, no link read) and the data directory alone, never of what exists on the host, so
    that the answer says nothing of it. It says what works from the command line too:
    ``heteroplane app apply`` (:func:`load_spec`) sends a relative path made absolute beside the
    spec file, so a spec file outside the data directory reaches it only by absolute paths."""
    base = Path(root).expanduser().resolve()
    named = [(f"models[{k}].profiles", m.profiles) for k, m in enumerate(spec.models)]
    named += [("catalog", spec.catalog), ("validation", spec.validation)]
    for field, text in named:
        if text is None:
            continue
        candidate = Path(text).expanduser()
        if not (base / candidate).resolve().is_relative_to(base):
            taken = "" if candidate.is_absolute() else f", taken as {os.path.normpath(base / text)}"
            raise SpecError(
                field,
                # The API cuts a message at 500 characters: the paths first, the advice after.
                f"must name a file in the service's data directory, {base}; {text}{taken} is"
                " outside it ('..' and links followed). Give the file's absolute path there, or"
                " a path relative to it in a spec sent to the API as is (heteroplane app apply"
                " makes relative paths absolute beside the spec file)",
            )


# --- checking it against the data ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResolvedArtifact:
    """A model's registered artifact: ``ref`` what a worker loads (served as the model's name,
    pinned to one version), ``signature`` its inputs and outputs, ``certainty`` how a cascade
    reads it (``margin`` or ``max_prob``)."""

    # provisioners.artifacts' ArtifactRef and ModelSignature, not imported: the policies read
    # this module and stay clear of provisioners (the import-linter's contract).
    ref: Any
    signature: Any
    certainty: str = "margin"
    size_bytes: int | None = None  # the registered file's size (None: not known)


@dataclass(frozen=True, slots=True)
class PlanningConstraints:
    """The limits an app's plans and fleets must hold to, derived once from its spec
    (:attr:`ResolvedApp.constraints`) and passed to every consumer: the planner, the tuner's
    config (live and replayed), INFaaS's autoscaler and the capacity re-planner. A field the
    spec gains for planning is added here and read by whoever needs it, not copied by each.

    ``slo_ms`` and ``percentile``: the latency SLO; ``stage_slo_ms`` is what the stages share
    once the control plane's own time per query (``serving_overhead_ms``) is taken off.
    ``budget_usd_per_hr``: a hard limit. ``instance_types``: the candidate types, in spec order.
    ``max_counts``: the most instances of a type the app may run (only the capped types).
    ``accuracy``: a cascade's accuracy floor (``None``: none).

    >>> limits = PlanningConstraints(100.0, 99.0, 2.0, ("a", "b"), {"a": 3})
    >>> limits.caps(["a", "b"]), limits.max_count("b"), limits.usable("a")
    ({'a': 3}, None, True)
    >>> limits.capped({"a": 5, "b": 0}).max_counts == {"a": 3, "b": 0}
    True
    """

    slo_ms: float
    percentile: float
    budget_usd_per_hr: float
    instance_types: tuple[str, ...]
    max_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    serving_overhead_ms: float = 0.0
    accuracy: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_counts", MappingProxyType(dict(self.max_counts)))

    @classmethod
    def of(cls, spec: AppSpec, serving_overhead_ms: float = 0.0) -> PlanningConstraints:
        """The constraints ``spec`` states (with the measured ``serving_overhead_ms``)."""
        return cls(
            slo_ms=float(spec.slo.latency_ms),
            percentile=float(spec.slo.percentile),
            budget_usd_per_hr=float(spec.budget_usd_per_hr),
            instance_types=tuple(spec.instance_types),
            max_counts=dict(spec.max_counts or {}),
            serving_overhead_ms=serving_overhead_ms,
            accuracy=spec.slo.accuracy,
        )

    @property
    def stage_slo_ms(self) -> float:
        """The SLO the stages share: ``slo_ms`` less the control plane's own time per query."""
        return self.slo_ms - self.serving_overhead_ms

    def max_count(self, instance_type: str) -> int | None:
        """The most instances of ``instance_type`` the app may run (``None``: no cap)."""
        return self.max_counts.get(instance_type)

    def caps(self, types: Iterable[str]) -> dict[str, int]:
        """The caps of those of ``types`` that have one."""
        return {t: n for t in types if (n := self.max_counts.get(t)) is not None}

    def held_caps(self, types: Iterable[str]) -> dict[str, int]:
        """:meth:`caps`, and 0 for those of ``types`` the spec does not list (a plan may not use
        them: what a tuner that reached a fleet of them holds it to, the planner's rule)."""
        named = list(types)
        return self.caps(named) | {t: 0 for t in named if t not in self.instance_types}

    def usable(self, instance_type: str) -> bool:
        """Whether a plan may use ``instance_type``: a candidate whose cap is not 0."""
        return instance_type in self.instance_types and self.max_counts.get(instance_type) != 0

    def capped(self, caps: Mapping[str, int]) -> PlanningConstraints:
        """These constraints with ``caps`` added (the lower cap where a type has both)."""
        merged = dict(self.max_counts)
        for name, cap in caps.items():
            merged[name] = min(cap, merged.get(name, cap))
        return dataclasses.replace(self, max_counts=merged)


@dataclass(frozen=True, slots=True)
class ResolvedApp:
    """An app spec checked against its catalog and profiles, with what they say loaded.

    ``profiles`` maps each model to its profile set (which holds every candidate type);
    ``prices_usd_per_hr`` maps each candidate type to its on-demand price, in spec order;
    ``validation`` holds the cascade's validation records when the spec names them;
    ``serving_overhead_ms`` is the control plane's own time per query that no worker profile
    holds (the API before the serving loop), as the service measured it for this app (0 when it
    has not: a spec resolved offline, or an app not served yet), its median;
    ``serving_overhead_quantiles_ms`` its measured distribution (quantiles at 0, 1, ..., 100 %;
    empty when not measured): the planner adds a draw from it to every query's simulated latency
    (the median when it is empty), and takes the median off the SLO the stages share.
    ``serving_cpu_ms`` is the serving process's CPU time per answered query as the service
    measured it (0: not measured): the planner serves every query that long at the serving
    process, a queue in front of the workers, and adds each query's wait there.
    ``artifacts`` maps each model served from the registry to its
    :class:`ResolvedArtifact` (the spec then names its version: pinned). ``unprofiled`` maps each
    artifact model whose profiles the service has not measured yet (no ``profiles`` file, and
    the stored measurements lack some candidate type) to the candidate types it lacks; such a
    model is not in ``profiles``, and nothing can be planned until it is measured.
    """

    spec: AppSpec
    catalog: Catalog
    profiles: Mapping[str, ProfileSet]
    prices_usd_per_hr: Mapping[str, float]
    validation: ValidationRecords | None = None
    serving_overhead_ms: float = 0.0
    serving_overhead_quantiles_ms: tuple[float, ...] = ()
    serving_cpu_ms: float = 0.0
    artifacts: Mapping[str, ResolvedArtifact] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    unprofiled: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )

    @property
    def constraints(self) -> PlanningConstraints:
        """The limits plans and fleets of this app hold to (:class:`PlanningConstraints`)."""
        return PlanningConstraints.of(self.spec, self.serving_overhead_ms)

    def with_constraints(self, constraints: PlanningConstraints) -> ResolvedApp:
        """This app planned under ``constraints`` instead of its spec's (the capacity
        re-planner's tighter caps, a changed budget): the spec is updated to state them, so
        every consumer reads the same limits from :attr:`constraints`."""
        spec = self.spec.model_copy(
            update={
                "budget_usd_per_hr": constraints.budget_usd_per_hr,
                "max_counts": dict(constraints.max_counts) or None,
                "slo": self.spec.slo.model_copy(
                    update={
                        "latency_ms": constraints.slo_ms,
                        "percentile": constraints.percentile,
                        "accuracy": constraints.accuracy,
                    }
                ),
                "instance_types": list(constraints.instance_types),
            }
        )
        return dataclasses.replace(
            self, spec=spec, serving_overhead_ms=constraints.serving_overhead_ms
        )

    def certainty(self, model: str) -> str:
        """How a cascade reads ``model``'s certainty: ``margin`` or ``max_prob``."""
        for entry in self.spec.models:
            if entry.name == model:
                return entry.certainty
        raise UnknownModelError(model, self.spec.model_names)

    @property
    def cascade(self) -> Cascade | None:
        """The cascade with its thresholds, when the spec gives both (else ``None``)."""
        if self.spec.cascade is None or self.spec.thresholds is None:
            return None
        from estimator.cascades import Cascade

        return Cascade(tuple(self.spec.cascade), tuple(self.spec.thresholds))

    @property
    def instance_types(self) -> list[str]:
        """The candidate instance types, in spec order."""
        return list(self.spec.instance_types)

    def profile(self, model: str, instance_type: str) -> LatencyProfile:
        """The latency profile of ``model`` on ``instance_type``."""
        try:
            profiles = self.profiles[model]
        except KeyError:
            if model in self.unprofiled:
                raise UnprofiledModelError(self.spec.name, model, list(self.profiles)) from None
            raise UnknownModelError(model, list(self.profiles)) from None
        return profiles.get_profile(model, instance_type)


def resolve_spec(
    spec: AppSpec,
    base_dir: str | Path | None = None,
    *,
    artifacts: Mapping[str, ResolvedArtifact] | None = None,
    measured: ProfileSet | None = None,
) -> ResolvedApp:
    """Load the catalog and profiles a spec names and check the spec against them.

    Checks: every candidate type is in the catalog (default catalog, with ``catalog`` added or
    overriding), every model is in its profile file, every (model, candidate type) pair has a
    profile, and the budget buys at least one instance of the cheapest candidate. Relative paths
    resolve against ``base_dir`` (for a spec that came as an API body; :func:`load_spec` has
    already anchored them), else the working directory.

    ``artifacts`` are the models with an ``artifact`` as the service's registry resolved them
    (by model name; :mod:`controlplane.apps.resolver` looks them up and pins the spec). Such a
    model's profiles are its ``profiles`` file when it names one, else ``measured`` (what the
    service measured for the app, ``heteroplane profile run``); a candidate type measured for
    neither is in :attr:`ResolvedApp.unprofiled`, not an error. Without ``artifacts`` (offline
    planning) an artifact model needs its ``profiles`` file.
    """
    if base_dir is not None:
        spec = anchor_paths(spec, base_dir)
    found = dict(artifacts or {})
    for i, model in enumerate(spec.models):
        if model.artifact is not None and model.name not in found and model.profiles is None:
            raise SpecError(
                f"models[{i}].artifact",
                "a registry model is measured and served by the service: register the app"
                " there (heteroplane app apply -f FILE), or name a profiles file to plan offline",
            )
    catalog = _load_spec_catalog(spec.catalog)
    for i, name in enumerate(spec.instance_types):
        if name not in catalog:
            raise SpecUnknownInstanceTypeError(f"instance_types[{i}]", name, catalog.names)
    prices = {name: catalog.price_usd_per_hr(name) for name in spec.instance_types}
    for i, name in enumerate(spec.instance_types):
        if prices[name] <= 0 and spec.max_count(name) is None:
            # The budget bounds a type's count by its price; a free type needs a cap instead.
            raise SpecError(
                f"instance_types[{i}]",
                f"{name} costs nothing, so the budget does not bound how many run:"
                f" give it a cap in max_counts",
            )
    if spec.spot_enabled and not any(catalog[name].has_spot for name in spec.instance_types):
        raise SpecError(
            "spot.enabled",
            "none of instance_types has a spot price in the catalog (its spot_price_usd_per_hr"
            " column): give one, or leave spot off",
        )

    files: dict[str, ProfileSet] = {}
    profiles: dict[str, ProfileSet] = {}
    unprofiled: dict[str, tuple[str, ...]] = {}
    for i, model in enumerate(spec.models):
        field = f"models[{i}].profiles"
        if model.profiles is None:
            # An artifact model (the schema asks for one of the two): the service measures it.
            have = (
                set(measured.instance_types(model.name))
                if measured is not None and model.name in measured.models
                else set()
            )
            lacking = tuple(name for name in spec.instance_types if name not in have)
            if lacking:
                unprofiled[model.name] = lacking
            else:
                assert measured is not None
                profiles[model.name] = measured
            continue
        if model.profiles not in files:
            files[model.profiles] = _load_spec_profiles(field, model.profiles)
        profile_set = files[model.profiles]
        if model.name not in profile_set.models:
            raise SpecUnknownModelError(
                f"models[{i}].name", model.name, profile_set.models, model.profiles
            )
        covered = set(profile_set.instance_types(model.name))
        for name in spec.instance_types:
            if name not in covered:
                raise SpecMissingProfileError(field, model.name, name, model.profiles)
        profiles[model.name] = profile_set
    check_budget_buys_one(spec, catalog, measuring=bool(unprofiled))
    return ResolvedApp(
        spec=spec,
        catalog=catalog,
        profiles=MappingProxyType(profiles),
        prices_usd_per_hr=MappingProxyType(prices),
        validation=_load_spec_validation(spec),
        artifacts=MappingProxyType(found),
        unprofiled=MappingProxyType(unprofiled),
    )


def check_slo_reachable(app: ResolvedApp) -> None:
    """:class:`SpecError` naming ``slo.latency_ms`` when no model of ``app`` answers within it on
    any candidate type even alone, at its smallest batch size (its mean service time, the least
    a query can take): no fleet meets it, every plan preview is refused and a live app refuses
    every query (429). The rule an app is registered and replaced under. A model still to be
    measured has no time yet: the app is not judged until it has."""
    if app.unprofiled:
        return
    fastest: tuple[float, str, str] | None = None
    for model in app.spec.models:
        profile_set = app.profiles[model.name]
        for name in app.spec.instance_types:
            if name not in profile_set.instance_types(model.name):
                continue
            profile = profile_set.get_profile(model.name, name)
            ms = profile.mean_latency_ms(profile.min_batch_size)
            if fastest is None or ms < fastest[0]:
                fastest = (ms, model.name, name)
    slo_ms = app.spec.slo.latency_ms
    if fastest is not None and fastest[0] > slo_ms:
        ms, model_name, name = fastest
        raise SpecError(
            "slo.latency_ms",
            f"{plain(slo_ms)} ms is less than any model takes alone: the fastest, {model_name!r}"
            f" on {name}, takes {ms:.3g} ms a query at its smallest batch, so no fleet meets it",
        )


def _load_spec_validation(spec: AppSpec) -> ValidationRecords | None:
    if spec.validation is None:
        return None
    path = spec.validation
    if not _is_file("validation", path):
        raise SpecError("validation", f"no such file: {path}")
    try:
        from estimator.cascades import load_validation

        records = load_validation(path)
    except EstimatorError as error:
        raise SpecError("validation", str(error)) from error
    except OSError as error:
        raise SpecError("validation", f"cannot read {path}: {error.strerror or error}") from None
    missing = [name for name in spec.serving_order if name not in records.models]
    if missing:
        raise SpecError(
            "validation",
            f"{path} has no records of {', '.join(missing)} (it has {', '.join(records.models)})",
        )
    return records


def _load_spec_catalog(path: str | None) -> Catalog:
    if path is not None and not _is_file("catalog", path):
        raise SpecError("catalog", f"no such file: {path}")
    try:
        from estimator.catalog import load_catalog

        return load_catalog(path)
    except SpecError:
        raise
    except EstimatorError as error:
        raise SpecError("catalog", str(error)) from error


def _is_file(field: str, path: str) -> bool:
    """Whether ``path`` is a file; a path the OS cannot even look up (a NUL byte in it) is the
    spec's error, not the service's."""
    try:
        return Path(path).is_file()
    except (ValueError, OSError) as error:
        raise SpecError(field, f"not a usable path: {error}") from None


def _load_spec_profiles(field: str, path: str) -> ProfileSet:
    if not _is_file(field, path):
        raise SpecError(field, f"no such file: {path}")
    try:
        from estimator.profiles import load_profiles

        return load_profiles(path)
    except EstimatorError as error:
        raise SpecError(field, str(error)) from error
    except OSError as error:
        raise SpecError(field, f"cannot read {path}: {error.strerror or error}") from None
