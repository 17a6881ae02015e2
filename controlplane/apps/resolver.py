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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.spec import (
    AppSpec,
    ResolvedApp,
    SpecError,
    anchor_paths,
    resolve_spec,
    validate_spec,
)
from estimator.profiles import LatencyProfile, ProfileSet

__all__ = [
    "AppResolver",
    "OverheadSource",
    "ScaleSource",
    "scaled_profiles",
    "smallest_common_batch_size",
    "spec_document",
]

ScaleSource = Callable[[str], Mapping[tuple[str, str], float]]
"""An app name -> its calibration factors by (model, instance type) (empty for an app that has
none, or is not registered)."""

OverheadSource = Callable[[str], float | None]
"""An app name -> the control plane's measured overhead per query, ms (None: not measured, or
not registered)."""

_CACHED_APPS = 32


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


def scaled_profiles(app: ResolvedApp, scales: Mapping[tuple[str, str], float]) -> ResolvedApp:
    """``app`` with the samples of each (model, instance type) profile in ``scales`` multiplied
    by its factor (the others as they are; a factor for a pair the app lacks is ignored)."""
    wanted = {key: f for key, f in scales.items() if f != 1.0}
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
                (_scaled(p, wanted[key]) if key in wanted else p for key, p in found.items()),
                found.source,
            )
        profiles[model] = rebuilt[id(found)]
    return dataclasses.replace(app, profiles=profiles)


def _scaled(profile: LatencyProfile, factor: float) -> LatencyProfile:
    return LatencyProfile(
        profile.model,
        profile.instance_type,
        profile.batch_sizes,
        tuple(np.asarray(cell, dtype=np.float64) * factor for cell in profile.samples_ms),
    )


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
    ) -> None:
        self.base_dir = base_dir
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, ResolvedApp] = OrderedDict()
        self._scale_source = scales
        self._scales: dict[str, tuple[tuple[tuple[str, str], float], ...]] = {}
        self._overhead_source = overheads
        self._overheads: dict[str, float] = {}

    def invalidate(self, app: str) -> None:
        """Forget ``app``'s calibration factors and overhead: the next resolve reads them
        again."""
        with self._lock:
            self._scales.pop(app, None)
            self._overheads.pop(app, None)

    def _app_overhead(self, app: str) -> float:
        if self._overhead_source is None:
            return 0.0
        with self._lock:
            found = self._overheads.get(app)
        if found is None:
            measured = self._overhead_source(app)
            found = 0.0 if measured is None else float(measured)
            with self._lock:
                self._overheads[app] = found
        return found

    def _app_scales(self, app: str) -> tuple[tuple[tuple[str, str], float], ...]:
        if self._scale_source is None:
            return ()
        with self._lock:
            found = self._scales.get(app)
        if found is None:
            found = tuple(sorted(self._scale_source(app).items()))
            with self._lock:
                self._scales[app] = found
        return found

    def check(self, document: object) -> ResolvedApp:
        """Validate a request body as an app spec and resolve it (:class:`SpecError` naming the
        field on any problem); the resolved spec's paths are absolute."""
        return self.resolve(validate_spec(document))

    def resolve(
        self, spec: AppSpec | Mapping[str, Any], *, check_budget: bool = True
    ) -> ResolvedApp:
        """Resolve a spec (or a stored spec document) against its catalog and profiles.

        ``check_budget=False`` skips the rule that the budget buys the cheapest candidate (a
        budget lowered below it is allowed: the fleet drains)."""
        if not isinstance(spec, AppSpec):
            spec = validate_spec(spec)
        scales = self._app_scales(spec.name)
        key = json.dumps(
            {k: v for k, v in spec_document(spec).items() if k != "budget_usd_per_hr"},
            sort_keys=True,
        )
        if scales:
            key += json.dumps([[m, t, f] for (m, t), f in scales])
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            # Resolved without a budget (an infinite one), so one cached entry serves them all.
            unbounded = spec.model_copy(update={"budget_usd_per_hr": math.inf})
            try:
                cached = resolve_spec(unbounded, self.base_dir)
            except SpecError as error:
                raise _without_file_content(error, anchor_paths(spec, self.base_dir)) from None
            cached = scaled_profiles(cached, dict(scales))
            with self._lock:
                self._cache[key] = cached
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        resolved = dataclasses.replace(
            cached,
            spec=cached.spec.model_copy(update={"budget_usd_per_hr": spec.budget_usd_per_hr}),
            serving_overhead_ms=self._app_overhead(spec.name),
        )
        if check_budget:
            _check_budget(resolved)
        return resolved


_FILE_FIELD = re.compile(r"^(catalog|models\[(\d+)\]\.profiles)$")


def _without_file_content(error: SpecError, spec: AppSpec) -> SpecError:
    """``error`` as is, unless it is about the content of a file the spec names: then a message
    that says which file and what it should be, and nothing of what it holds."""
    found = _FILE_FIELD.match(error.field)
    if found is None or error.problem.startswith("no such file"):
        return error
    if found.group(2) is not None:
        path = spec.models[int(found.group(2))].profiles
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
    prices = app.prices_usd_per_hr
    cheapest = min(prices, key=lambda name: prices[name])
    if prices[cheapest] > app.spec.budget_usd_per_hr:
        raise SpecError(
            "budget_usd_per_hr",
            f"{app.spec.budget_usd_per_hr:g} USD/hr buys no instance: the cheapest candidate,"
            f" {cheapest}, costs {prices[cheapest]:g} USD/hr",
        )
