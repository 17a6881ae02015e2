"""App specs from the API checked against their data, with the loaded data kept for reuse.

The API accepts the same spec document as the CLI (:mod:`controlplane.spec`). A spec that came
as a body has no file to anchor its relative paths to, so they resolve against the service's
``data_dir``; the stored spec holds the anchored, absolute paths. Resolving reads the catalog and
the profile files (close to a second for the Kairos samples), so :class:`AppResolver` keeps the
last few resolved apps, keyed by the spec without its budget: a budget change, which is frequent,
re-checks only the budget rule.

The files a spec names are read by the service, so a spec can point at any file the service may
read. What a file holds must not come back in an error message (a catalog "header" that is the
first line of ``/proc/self/environ`` would hand an operator the service's secrets): a file that is
not a valid catalog or profile file is reported without its content, with a pointer to the CLI
(``heteroplane plan --spec``), which reads the file on the caller's own machine and says what is
wrong in detail.

Online calibration (:mod:`controlplane.loops.calibration`) stores a factor per (app, model,
instance type) when the serving loop finds a profile off; a resolver given a ``scales`` source
returns the app's profiles with their samples multiplied by those factors, so every reader of a
resolved app (the live tuner, the gear switcher, the serving loop, a plan preview) sees the
calibrated profiles. The factors of an app are read once and kept until :meth:`AppResolver.
invalidate` (the calibration loop calls it when it stores a new one); they live in the database,
so they survive restarts.

Models a user brings (``artifact:`` in the spec, the service's registry) resolve through an
``artifacts`` source (:data:`ArtifactSource`, the store's ``get_model_version``): a spec that
names ``NAME`` comes back pinned to ``NAME@VERSION``, the latest (what registering an app
stores), and the resolved app carries each model's :class:`~controlplane.spec.ResolvedArtifact`.
An artifact model without a ``profiles`` file takes the profiles the service measured for the
app (``heteroplane profile run``), read through a ``measured`` source (:data:`ProfileSource`,
the store's ``get_app_profiles``) and kept until :meth:`AppResolver.invalidate` or for
:data:`MEASURED_RECHECK_S` (30 s), whichever comes first: another process may have stored new
ones and told this one nothing (the loops process, when its serving process ran `profile run`;
another replica); until they exist, each resolve reads them again and the app resolves with the
model in ``unprofiled`` (registered, not plannable).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from controlplane.policies.calibration import spread_samples
from controlplane.spec import (
    AppSpec,
    ResolvedApp,
    ResolvedArtifact,
    SpecError,
    SpecMissingProfileError,
    anchor_paths,
    check_budget_buys_one,
    check_slo_reachable,
    confine_paths,
    resolve_spec,
    validate_spec,
)
from estimator.errors import ProfileError
from estimator.profiles import LatencyProfile, ProfileSet, profiles_from_document
from provisioners.artifacts import FAMILY_SIGNATURE, ArtifactError, ArtifactRef, ModelSignature

__all__ = [
    "MEASURED_RECHECK_S",
    "AppResolver",
    "ArtifactSource",
    "Calibrated",
    "OverheadSource",
    "ProfileSource",
    "RegisteredModel",
    "ScaleSource",
    "pin_artifacts",
    "resolve_artifacts",
    "scaled_profile",
    "scaled_profiles",
    "smallest_common_batch_size",
    "spec_document",
]

Calibrated = float | tuple[float, tuple[float, ...]]
"""A (model, instance type)'s calibration: its factor, or (factor, spread) where the live round
trips' unit-mean shape was stored (quantiles at :data:`~controlplane.policies.calibration.
OVERHEAD_QUANTILES`; empty: the profile's own)."""

ScaleSource = Callable[[str], Mapping[tuple[str, str], Calibrated]]
"""An app name -> its calibrations by (model, instance type) (empty for an app that has none,
or is not registered)."""

OverheadSource = Callable[
    [str],
    float | tuple[float, tuple[float, ...]] | tuple[float, tuple[float, ...], float | None] | None,
]
"""An app name -> the control plane's measured overhead per query, ms: its median, or (median,
its quantiles at :data:`~controlplane.policies.calibration.OVERHEAD_QUANTILES`), or those and the
serving process's CPU per query (None: not measured) (None: not measured, or not registered)."""


class RegisteredModel(Protocol):
    """A version of a registry model as the resolver needs it (the store's
    ``ModelVersionRecord`` is one)."""

    @property
    def version(self) -> int: ...

    @property
    def signature(self) -> ModelSignature: ...

    def ref(self, serve_as: str) -> ArtifactRef: ...


ArtifactSource = Callable[[str, int | None], RegisteredModel]
"""A registry model's name and version (None: the latest) -> that version (the store's
``get_model_version``); raises ``NotFoundError`` (a ``LookupError``) when there is none."""

ProfileSource = Callable[[str], Mapping[str, Any] | None]
"""An app name -> the profile JSON document the service measured for it (None: none yet)."""

_CACHED_APPS = 32
_measured_tokens = itertools.count(1)
# How long measured profiles are kept before the document is read again: another process (a
# serving process that ran `profile run`, another replica) may have stored new ones and told
# this one nothing. The same document read again keeps its token (and the resolved apps).
MEASURED_RECHECK_S = 30.0


def spec_document(spec: AppSpec) -> dict[str, Any]:
    """The spec as the JSON document the store keeps (optional fields left out when unset)."""
    return spec.model_dump(mode="json", exclude_none=True)


def smallest_common_batch_size(app: ResolvedApp) -> int:
    """The smallest batch size every (model, candidate type) profile of ``app`` covers."""
    return max(
        app.profile(model, instance_type).min_batch_size
        for model in app.spec.model_names
        for instance_type in app.instance_types
    )


def scaled_profiles(app: ResolvedApp, scales: Mapping[tuple[str, str], Calibrated]) -> ResolvedApp:
    """``app`` with each (model, instance type) profile in ``scales`` calibrated
    (:func:`scaled_profile`; the others as they are; a pair the app lacks is ignored)."""
    wanted = {
        key: (f, ()) if isinstance(f, int | float) else f
        for key, f in scales.items()
        if not (isinstance(f, int | float) and f == 1.0)
    }
    if not wanted:
        return app
    rebuilt: dict[int, ProfileSet] = {}
    profiles: dict[str, ProfileSet] = {}
    for model, found in app.profiles.items():
        if not any(key in wanted for key in found):
            profiles[model] = found
            continue
        if id(found) not in rebuilt:
            rebuilt[id(found)] = ProfileSet(
                (
                    scaled_profile(p, *wanted[key]) if key in wanted else p
                    for key, p in found.items()
                ),
                found.source,
            )
        profiles[model] = rebuilt[id(found)]
    return dataclasses.replace(app, profiles=profiles)


def scaled_profile(
    profile: LatencyProfile, factor: float, spread: Sequence[float] = ()
) -> LatencyProfile:
    """``profile`` with every sample multiplied by ``factor`` (a calibration's); with a
    ``spread`` (a unit-mean shape, :func:`~controlplane.policies.calibration.spread_samples`),
    each batch size's samples are that shape about the calibrated mean instead."""
    if spread:
        cells = tuple(spread_samples(spread, float(mean) * factor) for mean in profile.mean_ms)
    else:
        cells = tuple(np.asarray(cell, dtype=np.float64) * factor for cell in profile.samples_ms)
    return LatencyProfile(profile.model, profile.instance_type, profile.batch_sizes, cells)


class AppResolver:
    """Validate and resolve spec documents against ``base_dir``; thread-safe, cached. With
    ``scales``, the profiles come calibrated (module docstring)."""

    def __init__(
        self,
        base_dir: Path,
        capacity: int = _CACHED_APPS,
        *,
        scales: ScaleSource | None = None,
        overheads: OverheadSource | None = None,
        artifacts: ArtifactSource | None = None,
        measured: ProfileSource | None = None,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_dir = base_dir
        self._clock_s = clock_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, ResolvedApp] = OrderedDict()
        self._scale_source = scales
        self._scales: dict[str, tuple[tuple[tuple[str, str], Calibrated], ...]] = {}
        self._overhead_source = overheads
        self._overheads: dict[str, tuple[float, tuple[float, ...], float]] = {}
        self._artifact_source = artifacts
        self._measured_source = measured
        # app -> (a token that changes whenever another document is read, its profiles, when it
        # was read, the document's text).
        self._measured: dict[str, tuple[int, ProfileSet | None, float, str]] = {}
        # app -> how many times it was invalidated (:meth:`generation`).
        self._generations: dict[str, int] = {}

    def invalidate(self, app: str) -> None:
        """Forget ``app``'s calibration factors, overhead and measured profiles: the next
        resolve reads them again."""
        with self._lock:
            self._scales.pop(app, None)
            self._overheads.pop(app, None)
            self._measured.pop(app, None)
            self._generations[app] = self._generations.get(app, 0) + 1

    def generation(self, app: str) -> int:
        """How many times ``app`` was invalidated (a calibration stored): a reader that keeps
        what it resolved (the serving loop's dispatcher configuration) resolves again when it
        moves, so that it serves on the calibrated profiles the plans and the tuner read."""
        with self._lock:
            return self._generations.get(app, 0)

    def _app_measured(self, app: str) -> tuple[int, ProfileSet | None]:
        """``app``'s measured profiles and a token naming them: kept for
        :data:`MEASURED_RECHECK_S`, then read again (the same document keeps its token); none
        stored is not kept (each resolve reads: the app cannot be planned or served without
        them, and another process may store them at any time)."""
        if self._measured_source is None:
            return 0, None
        now = self._clock_s()
        with self._lock:
            found = self._measured.get(app)
        if found is not None and now - found[2] < MEASURED_RECHECK_S:
            return found[0], found[1]
        document = self._measured_source(app)
        if document is None:
            with self._lock:
                self._measured.pop(app, None)
            return 0, None
        text = json.dumps(document, sort_keys=True)
        if found is not None and found[3] == text:
            token, profiles = found[0], found[1]
        else:
            try:
                profiles = profiles_from_document(document, f"the profiles measured for {app}")
            except ProfileError as error:
                raise SpecError("models", str(error)) from None
            token = next(_measured_tokens)
        with self._lock:
            self._measured[app] = (token, profiles, now, text)
        return token, profiles

    def _app_overhead(self, app: str) -> tuple[float, tuple[float, ...], float]:
        """``app``'s measured overhead per query: (median ms, quantiles ms; empty when not
        measured, the serving process's CPU ms per query; 0 when not measured); (0, (), 0)
        before any."""
        if self._overhead_source is None:
            return 0.0, (), 0.0
        with self._lock:
            found = self._overheads.get(app)
        if found is None:
            measured = self._overhead_source(app)
            if measured is None:
                found = (0.0, (), 0.0)
            elif isinstance(measured, tuple):
                cpu = measured[2] if len(measured) > 2 else None
                found = (
                    float(measured[0]),
                    tuple(float(q) for q in measured[1]),
                    0.0 if cpu is None else float(cpu),
                )
            else:
                found = (float(measured), (), 0.0)
            with self._lock:
                self._overheads[app] = found
        return found

    def _app_scales(self, app: str) -> tuple[tuple[tuple[str, str], Calibrated], ...]:
        if self._scale_source is None:
            return ()
        with self._lock:
            found = self._scales.get(app)
        if found is None:
            found = tuple(sorted(self._scale_source(app).items()))
            with self._lock:
                self._scales[app] = found
        return found

    def check(self, document: object, *, confine: bool = True) -> ResolvedApp:
        """Validate a request body as an app spec and resolve it (:class:`SpecError` naming the
        field on any problem: a file path outside ``base_dir`` is one,
        :func:`~controlplane.spec.confine_paths`); the resolved spec's paths are absolute.
        ``confine=False`` is for the service's own specs (the demo's, naming its family's files
        wherever the demo trained them), never for a request's. An SLO no model meets alone is
        refused here (:func:`~controlplane.spec.check_slo_reachable`), where an app is
        registered or replaced, not where a stored one is resolved."""
        spec = validate_spec(document)
        if confine:
            confine_paths(spec, self.base_dir)
        resolved = self.resolve(spec)
        check_slo_reachable(resolved)
        return resolved

    def resolve(
        self, spec: AppSpec | Mapping[str, Any], *, check_budget: bool = True
    ) -> ResolvedApp:
        """Resolve a spec (or a stored spec document) against its catalog and profiles.

        ``check_budget=False`` skips the rule that the budget buys the cheapest candidate (a
        budget lowered below it is allowed: the fleet drains)."""
        if not isinstance(spec, AppSpec):
            spec = validate_spec(spec)
        if self._artifact_source is not None:
            # NAME -> NAME@latest first: the cache is keyed by pinned specs (versions never
            # change), and a registered spec is stored pinned.
            spec = pin_artifacts(spec, self._artifact_source)
        scales = self._app_scales(spec.name)
        key = json.dumps(
            {k: v for k, v in spec_document(spec).items() if k != "budget_usd_per_hr"},
            sort_keys=True,
        )
        if scales:
            key += json.dumps([[m, t, f] for (m, t), f in scales])  # a spread as a list
        measured: ProfileSet | None = None
        if any(model.profiles is None for model in spec.models):
            token, measured = self._app_measured(spec.name)
            key += f"|measured:{token}"
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            # Resolved without a budget (an infinite one), so one cached entry serves them all.
            unbounded = spec.model_copy(update={"budget_usd_per_hr": math.inf})
            try:
                found = (
                    resolve_artifacts(spec, self._artifact_source)
                    if self._artifact_source is not None
                    else None
                )
                cached = resolve_spec(unbounded, self.base_dir, artifacts=found, measured=measured)
            except SpecError as error:
                raise _without_file_content(error, anchor_paths(spec, self.base_dir)) from None
            cached = scaled_profiles(cached, dict(scales))
            with self._lock:
                self._cache[key] = cached
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        overhead_ms, overhead_quantiles_ms, cpu_ms = self._app_overhead(spec.name)
        resolved = dataclasses.replace(
            cached,
            spec=cached.spec.model_copy(update={"budget_usd_per_hr": spec.budget_usd_per_hr}),
            serving_overhead_ms=overhead_ms,
            serving_overhead_quantiles_ms=overhead_quantiles_ms,
            serving_cpu_ms=cpu_ms,
        )
        if check_budget:
            _check_budget(resolved)
        return resolved


def resolve_artifacts(spec: AppSpec, lookup: ArtifactSource) -> dict[str, ResolvedArtifact]:
    """The registered artifact of each model of ``spec`` that names one (by model name), looked
    up with ``lookup``; :class:`SpecError` naming ``models[i].artifact`` for one the registry
    does not have, or a cascade whose models take different inputs."""
    found: dict[str, ResolvedArtifact] = {}
    for i, model in enumerate(spec.models):
        reference = model.artifact_ref
        if reference is None:
            continue
        field = f"models[{i}].artifact"
        name, version = reference
        registered = _look_up(lookup, field, name, version)
        try:
            ref = registered.ref(model.name)
        except ArtifactError as error:
            raise SpecError(f"models[{i}].name", str(error)) from None
        # The file's size sizes the model's memory where the spec gives none (load_balance).
        size_bytes = getattr(registered, "size_bytes", None)
        found[model.name] = ResolvedArtifact(
            ref,
            registered.signature,
            model.certainty,
            size_bytes=size_bytes if isinstance(size_bytes, int) else None,
        )
    if found:
        _check_cascade_inputs(spec, found)
    return found


def pin_artifacts(spec: AppSpec, lookup: ArtifactSource) -> AppSpec:
    """``spec`` with every ``artifact: NAME`` pinned to ``NAME@VERSION``, the latest version
    ``lookup`` finds (what registering an app stores); :class:`SpecError` naming
    ``models[i].artifact`` for a name the registry does not have."""
    models = list(spec.models)
    for i, model in enumerate(spec.models):
        reference = model.artifact_ref
        if reference is None or reference[1] is not None:
            continue
        registered = _look_up(lookup, f"models[{i}].artifact", reference[0], None)
        models[i] = model.model_copy(update={"artifact": f"{reference[0]}@{registered.version}"})
    return spec if models == list(spec.models) else spec.model_copy(update={"models": models})


def _look_up(lookup: ArtifactSource, field: str, name: str, version: int | None) -> RegisteredModel:
    try:
        return lookup(name, version)
    except LookupError:
        which = f"version {version} of model {name!r}" if version else f"model {name!r}"
        raise SpecError(
            field, f"the registry has no {which} (heteroplane model list shows what it has)"
        ) from None


def _check_cascade_inputs(spec: AppSpec, found: Mapping[str, ResolvedArtifact]) -> None:
    """The members of a cascade take the same inputs (a query goes to each in turn) and answer
    the same outputs (an answer stacks rows that different members answered)."""
    if spec.cascade is None:
        return
    index = {model.name: i for i, model in enumerate(spec.models)}

    def tensors(name: str, side: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        artifact = found.get(name)
        signature = artifact.signature if artifact is not None else FAMILY_SIGNATURE
        specs = signature.inputs if side == "inputs" else signature.outputs
        return tuple((t.name, t.datatype, t.shape) for t in specs)

    def shown(name: str, side: str) -> str:
        return ", ".join(
            f"{tensor}:{datatype}:{'x'.join(map(str, shape))}"
            for tensor, datatype, shape in tensors(name, side)
        )

    first = spec.cascade[0]
    for side, verb in (("inputs", "take"), ("outputs", "answer")):
        for name in spec.cascade[1:]:
            if tensors(name, side) != tensors(first, side):
                i = index[name] if name in found else index[first]
                raise SpecError(
                    f"models[{i}].artifact",
                    f"the cascade's models must {verb} the same {side}: {first} {verb}s"
                    f" {shown(first, side)}, {name} {verb}s {shown(name, side)}",
                )


_FILE_FIELD = re.compile(r"^(catalog|models\[(\d+)\]\.profiles)$")


def _without_file_content(error: SpecError, spec: AppSpec) -> SpecError:
    """``error`` as is, unless it is about the content of a file the spec names: then a message
    that says which file and what it should be, and nothing of what it holds."""
    found = _FILE_FIELD.match(error.field)
    if (
        found is None
        or error.problem.startswith("no such file")
        or isinstance(error, SpecMissingProfileError)  # names only what the spec names
    ):
        return error
    if found.group(2) is not None:
        path = str(spec.models[int(found.group(2))].profiles)
        what = "a profile file (a Kairos samples CSV or the project's profile JSON)"
    else:
        path = str(spec.catalog)
        what = "a catalog (CSV or JSON with instance_type and price_usd_per_hr)"
    return SpecError(
        error.field,
        f"{path} cannot be read as {what}; `heteroplane plan --spec` on the spec file says why",
    )


def _check_budget(app: ResolvedApp) -> None:
    # The same rule as resolve_spec: the budget buys at least the cheapest candidate.
    check_budget_buys_one(app.spec, app.catalog, measuring=bool(app.unprofiled))
