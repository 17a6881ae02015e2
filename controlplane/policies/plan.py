"""The plan document, typed: what the planner returns, the store keeps and every reader parses.

A plan says, per stage of an app (one model, or each model of a cascade), which instances to run
(``fleet``: type -> count), at which batch size, under which dispatch policy, and what the
estimator predicts of it (P99, throughput, cost); for the whole app, whether it meets the SLO
within the budget (``feasible``), the rate it is planned for (``rate_qps``; also written as
``planned_rate_qps``, the name older documents and readers use), the predicted end-to-end P99 of
the whole pipeline at that rate (``predicted_p99_ms``; ``None`` for a plan without stages or a
document made before plans carried it), the search steps that explain it, the gear plan of a
cascade (``gear_plan``) and the planned arrival envelope (``envelope``: ``windows_s`` and
``rate_qps``). The service adds the seed and how the planning trace was made (``seed``,
``trace``). The JSON form is the ``plan --json`` contract (docs/planner.md), what ``replay
--plan`` reads and what ``/v1/apps/{app}/plans`` answers.

:meth:`PlanDocument.parse` checks a document once, at the boundary (a file, a database row);
past it, code reads attributes (``plan.fleet`` is the fleet summed over the stages) instead of
digging in dicts. A malformed envelope does not make the plan unreadable: the plan is kept
without one and ``envelope_problem`` says why (the live tuner falls back to its proxy and
logs it).

>>> plan = PlanDocument.parse({"feasible": True, "cost_usd_per_hr": 1.05, "steps": [],
...     "stages": [{"name": "m", "fleet": {"g4dn.xlarge": 2}, "batch_size": 1}]})
>>> str(plan.stages[0].fleet), plan.stages[0].batch_size, plan.fleet
('g4dn.xlarge=2', 1, {'g4dn.xlarge': 2})
>>> plan.rate_qps, plan.predicted_p99_ms  # a document from before plans carried them
(0.0, None)
>>> PlanDocument.parse({"feasible": True, "stages": []})
Traceback (most recent call last):
...
controlplane.policies.plan.PlanError: cost_usd_per_hr: is required
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from estimator.batches import MAX_BATCH_SIZE
from estimator.errors import EstimatorError, FleetError
from estimator.fleet import Fleet
from matching import registry

__all__ = ["DispatchName", "PlanDocument", "PlanError", "StagePlan", "read_plan"]

# The name of a dispatch policy a plan may name: one of ``matching.registry.plan_names()``.
DispatchName = str


class PlanError(EstimatorError):
    """A plan document that is malformed (not JSON, a field missing or of the wrong kind).

    ``field`` is the path of the offending value (``stages[0].fleet``; empty for the document).
    """

    def __init__(self, field: str, problem: str, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        super().__init__(": ".join(part for part in (source, field, problem) if part))


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage of a plan: its fleet (type -> count), batch size, dispatch policy, the share of
    the app's queries that reach it (``scale_factor``, s_m) and what the estimator says of it."""

    name: str
    fleet: Fleet
    batch_size: int
    predicted_p99_ms: float = 0.0
    throughput_qps: float = 0.0
    cost_usd_per_hr: float = 0.0
    policy: DispatchName | None = None
    scale_factor: float = 1.0
    # The dispatch policy's base types, preferred first, as the planner simulated them (the
    # live dispatcher keeps this order; empty: a document older than the field, or FCFS).
    base_types: tuple[str, ...] = ()
    # How many of ``fleet``'s instances are spot, by type (docs/spot.md; empty: all on demand).
    spot_fleet: Mapping[str, int] = field(default_factory=dict)

    def in_base_order(self, types: Sequence[str]) -> list[str]:
        """``types`` (base types a dispatcher could use) with those the plan ranks first, in its
        order (``base_types``), the rest after in their own order (a type the tuner added, a
        document older than the field): what the planner simulated, which the live dispatcher
        and the replay both follow.

        >>> StagePlan("m", {}, 1, base_types=("g4", "c5")).in_base_order(["c5", "r5", "g4"])
        ['g4', 'c5', 'r5']
        """
        ranked = [t for t in self.base_types if t in types]
        return ranked + [t for t in types if t not in ranked]

    def to_document(self) -> dict[str, Any]:
        return {
            "base_types": list(self.base_types),
            "spot_fleet": dict(self.spot_fleet),
            "name": self.name,
            "fleet": dict(self.fleet),
            "batch_size": self.batch_size,
            "predicted_p99_ms": self.predicted_p99_ms,
            "throughput_qps": self.throughput_qps,
            "cost_usd_per_hr": self.cost_usd_per_hr,
            "policy": self.policy,
            "scale_factor": self.scale_factor,
        }


@dataclass(frozen=True, slots=True)
class PlanDocument:
    """A plan for an app: ``feasible`` when every stage meets the SLO on the planning trace
    within the budget; otherwise ``max_feasible_qps`` is the highest rate that can be served,
    and the stages are planned for ``rate_qps`` (empty when not even the lowest rate can).
    ``predicted_p99_ms`` is the estimator's end-to-end P99 (the spec's percentile) of the whole
    pipeline at ``rate_qps`` (``None``: no stages, or a document older than the field).
    ``envelope_windows_s`` and ``envelope_rate_qps`` are the planned arrival envelope (both empty
    when the plan carries none)."""

    feasible: bool
    cost_usd_per_hr: float
    stages: tuple[StagePlan, ...]
    steps: tuple[str, ...] = ()
    rate_qps: float = 0.0
    predicted_p99_ms: float | None = None
    max_feasible_qps: float | None = None
    simulations: int = 0
    gear_plan: Mapping[str, Any] | None = None
    envelope_windows_s: tuple[float, ...] = ()
    envelope_rate_qps: tuple[float, ...] = ()
    # Added by the service: the planner's seed and how the planning trace was made.
    seed: int | None = None
    trace: Mapping[str, Any] | None = None
    envelope_problem: str | None = field(default=None, compare=False)
    # Spot (docs/spot.md): the cost at the prices used (None: cost_usd_per_hr, all on demand)
    # and if every spot instance were paid at its on-demand price. Written always (the cost for
    # an on-demand plan), so equality leaves them out: a plan reads back equal.
    expected_cost_usd_per_hr: float | None = field(default=None, compare=False)
    cost_if_on_demand_usd_per_hr: float | None = field(default=None, compare=False)
    # A plan with spot (docs/spot.md): the share of queries within the SLO it predicts with
    # interruptions, the spot prices it was made at and where they came from ("catalog",
    # "provider", "provider and catalog"). Written only when set.
    predicted_slo_attainment: float | None = field(default=None, compare=False)
    spot_prices_usd_per_hr: Mapping[str, float] | None = field(default=None, compare=False)
    spot_prices_source: str | None = field(default=None, compare=False)

    @property
    def planned_rate_qps(self) -> float:
        """``rate_qps`` by the name older documents and readers use."""
        return self.rate_qps

    @property
    def fleet(self) -> dict[str, int]:
        """The instances of every stage together, by type."""
        counts: dict[str, int] = {}
        for stage in self.stages:
            for name, count in stage.fleet.items():
                counts[name] = counts.get(name, 0) + count
        return counts

    def stage(self, name: str) -> StagePlan | None:
        """The stage that serves model ``name``, if the plan has one."""
        return next((s for s in self.stages if s.name == name), None)

    def to_document(self) -> dict[str, Any]:
        """The JSON document (the ``plan --json`` contract)."""
        document: dict[str, Any] = {
            "feasible": self.feasible,
            "cost_usd_per_hr": self.cost_usd_per_hr,
            "stages": [s.to_document() for s in self.stages],
            "rate_qps": self.rate_qps,
            "predicted_p99_ms": self.predicted_p99_ms,
            # The same rate under its older name, for stored documents' readers.
            "planned_rate_qps": self.rate_qps,
            "steps": list(self.steps),
            "simulations": self.simulations,
            # Spot (docs/spot.md); a plan all on demand costs cost_usd_per_hr either way.
            **{
                key: self.cost_usd_per_hr if value is None else value
                for key, value in (
                    ("expected_cost_usd_per_hr", self.expected_cost_usd_per_hr),
                    ("cost_if_on_demand_usd_per_hr", self.cost_if_on_demand_usd_per_hr),
                )
            },
        }
        if self.max_feasible_qps is not None:
            document["max_feasible_qps"] = self.max_feasible_qps
        if self.gear_plan is not None:
            document["gear_plan"] = dict(self.gear_plan)
        if self.envelope_windows_s:
            document["envelope"] = {
                "windows_s": list(self.envelope_windows_s),
                "rate_qps": list(self.envelope_rate_qps),
            }
        if self.seed is not None:
            document["seed"] = self.seed
        if self.trace is not None:
            document["trace"] = dict(self.trace)
        if self.predicted_slo_attainment is not None:
            document["predicted_slo_attainment"] = self.predicted_slo_attainment
        if self.spot_prices_usd_per_hr is not None:
            document["spot_prices_usd_per_hr"] = dict(self.spot_prices_usd_per_hr)
        if self.spot_prices_source is not None:
            document["spot_prices_source"] = self.spot_prices_source
        return document

    @classmethod
    def parse(cls, document: object, source: str | None = None) -> PlanDocument:
        """Check a parsed plan document and type it.

        Raises:
            PlanError: a document that is not a mapping, or a field missing or of the wrong
                kind (``source``, a file's name, prefixes the message).
        """
        if not isinstance(document, Mapping):
            raise PlanError("", f"a plan is a JSON object, got {type(document).__name__}", source)
        feasible = _field(document, "feasible", "", source)
        if not isinstance(feasible, bool):
            raise PlanError("feasible", f"must be true or false, got {feasible!r}", source)
        cost = _number(_field(document, "cost_usd_per_hr", "", source), "cost_usd_per_hr", source)
        stages_doc = _field(document, "stages", "", source)
        if not isinstance(stages_doc, list):
            raise PlanError("stages", "must be a list", source)
        stages = tuple(_stage(entry, f"stages[{i}]", source) for i, entry in enumerate(stages_doc))
        steps = document.get("steps") or []
        if not isinstance(steps, list):
            raise PlanError("steps", "must be a list of texts", source)
        gear_plan = document.get("gear_plan")
        if gear_plan is not None and not isinstance(gear_plan, Mapping):
            raise PlanError("gear_plan", "must be an object", source)
        max_feasible = document.get("max_feasible_qps")
        seed = document.get("seed")
        trace = document.get("trace")
        windows, rates, problem = _envelope(document.get("envelope"))
        predicted = document.get("predicted_p99_ms")
        return cls(
            feasible=feasible,
            cost_usd_per_hr=cost,
            stages=stages,
            steps=tuple(str(s) for s in steps),
            rate_qps=_rate(document, source),
            predicted_p99_ms=None
            if predicted is None
            else _at_least_zero(predicted, "predicted_p99_ms", source),
            max_feasible_qps=None
            if max_feasible is None
            else _number(max_feasible, "max_feasible_qps", source),
            simulations=_whole(document.get("simulations", 0), "simulations", source, 0),
            gear_plan=MappingProxyType(dict(gear_plan)) if gear_plan is not None else None,
            envelope_windows_s=windows,
            envelope_rate_qps=rates,
            seed=_whole(seed, "seed", source, 0) if seed is not None else None,
            trace=MappingProxyType(dict(trace)) if isinstance(trace, Mapping) else None,
            envelope_problem=problem,
            expected_cost_usd_per_hr=_optional_cost(document, "expected_cost_usd_per_hr", source),
            predicted_slo_attainment=_optional_share(document, "predicted_slo_attainment", source),
            spot_prices_usd_per_hr=_optional_prices(document, "spot_prices_usd_per_hr", source),
            spot_prices_source=_optional_text(document, "spot_prices_source", source),
            cost_if_on_demand_usd_per_hr=_optional_cost(
                document, "cost_if_on_demand_usd_per_hr", source
            ),
        )


def read_plan(path: str | Path) -> PlanDocument:
    """Read and check a plan document (JSON) from ``path``.

    Raises:
        PlanError: a file that cannot be read, is not JSON, or is not a plan.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError("", "no such file", source) from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError("", f"cannot read: {error}", source) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        problem = f"malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        raise PlanError("", problem, source) from None
    except RecursionError:
        raise PlanError("", "JSON nested too deeply to read", source) from None
    return PlanDocument.parse(document, source)


def _field(document: Mapping[str, Any], key: str, where: str, source: str | None) -> Any:
    if key not in document:
        raise PlanError(f"{where}{key}", "is required", source)
    return document[key]


def _whole(value: object, where: str, source: str | None, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(where, f"must be a whole number, got {value!r}", source)
    if value < low:
        raise PlanError(where, f"must be >= {low}, got {value}", source)
    return value


def _number(value: object, where: str, source: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanError(where, f"must be a finite number, got {value!r}", source)
    return float(value)


def _at_least_zero(value: object, where: str, source: str | None) -> float:
    number = _number(value, where, source)
    if number < 0:
        raise PlanError(where, f"must be >= 0, got {value!r}", source)
    return number


def _optional_cost(document: Mapping[str, Any], key: str, source: str | None) -> float | None:
    value = document.get(key)
    return None if value is None else _at_least_zero(value, key, source)


def _optional_share(document: Mapping[str, Any], key: str, source: str | None) -> float | None:
    value = document.get(key)
    if value is None:
        return None
    share = _at_least_zero(value, key, source)
    if share > 1:
        raise PlanError(key, f"must be a share, 0..1, got {value!r}", source)
    return share


def _optional_prices(
    document: Mapping[str, Any], key: str, source: str | None
) -> dict[str, float] | None:
    value = document.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise PlanError(key, "must be an object of type -> USD/hr", source)
    return {str(t): _at_least_zero(p, f"{key}[{t}]", source) for t, p in value.items()}


def _optional_text(document: Mapping[str, Any], key: str, source: str | None) -> str | None:
    value = document.get(key)
    if value is None or isinstance(value, str):
        return value
    raise PlanError(key, f"must be a text, got {value!r}", source)


def _rate(document: Mapping[str, Any], source: str | None) -> float:
    """``rate_qps``; a document older than it has ``planned_rate_qps`` only (or neither: 0).
    Both present must agree: they are one rate under two names."""
    rate = document.get("rate_qps")
    planned = document.get("planned_rate_qps")
    if rate is None:
        return 0.0 if planned is None else _at_least_zero(planned, "planned_rate_qps", source)
    number = _at_least_zero(rate, "rate_qps", source)
    if planned is not None:
        old = _at_least_zero(planned, "planned_rate_qps", source)
        if not math.isclose(number, old, rel_tol=1e-9, abs_tol=1e-12):
            problem = f"{number!r} disagrees with planned_rate_qps {old!r} (the same rate)"
            raise PlanError("rate_qps", problem, source)
    return number


def _stage(entry: object, where: str, source: str | None) -> StagePlan:
    if not isinstance(entry, Mapping):
        raise PlanError(where, "must be an object", source)
    name = _field(entry, "name", f"{where}.", source)
    if not isinstance(name, str) or not name:
        raise PlanError(f"{where}.name", f"must be a non-empty text, got {name!r}", source)
    fleet_doc = _field(entry, "fleet", f"{where}.", source)
    if not isinstance(fleet_doc, Mapping):
        raise PlanError(f"{where}.fleet", "must be an object of type -> count", source)
    counts = {str(t): _whole(c, f"{where}.fleet[{t}]", source, 0) for t, c in fleet_doc.items()}
    try:
        fleet = Fleet.of(counts)
    except FleetError as error:
        raise PlanError(f"{where}.fleet", str(error), source) from None
    # A stage without a batch size takes one query at a time.
    batch = _whole(entry.get("batch_size", 1), f"{where}.batch_size", source, 1)
    if batch > MAX_BATCH_SIZE:
        raise PlanError(
            f"{where}.batch_size", f"must be <= {MAX_BATCH_SIZE:,}, got {batch:,}", source
        )
    raw_policy = entry.get("policy")
    allowed = registry.plan_names()
    policy = next((name for name in allowed if name == raw_policy), None)
    if raw_policy is not None and policy is None:
        problem = f"must be one of {', '.join(allowed)}, got {raw_policy!r}"
        raise PlanError(f"{where}.policy", problem, source)
    numbers = {
        key: _number(entry.get(key, default), f"{where}.{key}", source)
        for key, default in (
            ("predicted_p99_ms", 0.0),
            ("throughput_qps", 0.0),
            ("cost_usd_per_hr", 0.0),
            ("scale_factor", 1.0),
        )
    }
    for key in ("predicted_p99_ms", "throughput_qps", "cost_usd_per_hr"):
        if numbers[key] < 0:
            raise PlanError(f"{where}.{key}", f"must be >= 0, got {entry.get(key)!r}", source)
    if not 0.0 <= numbers["scale_factor"] <= 1.0:  # the share of the queries reaching it
        problem = f"must be in [0, 1], got {entry.get('scale_factor')!r}"
        raise PlanError(f"{where}.scale_factor", problem, source)
    raw_base = entry.get("base_types", [])
    if not isinstance(raw_base, list) or not all(isinstance(t, str) for t in raw_base):
        raise PlanError(f"{where}.base_types", "must be a list of instance type names", source)
    raw_spot = entry.get("spot_fleet") or {}
    if not isinstance(raw_spot, Mapping):
        raise PlanError(f"{where}.spot_fleet", "must be an object of type -> count", source)
    spot_fleet = {
        str(t): _whole(c, f"{where}.spot_fleet[{t}]", source, 0) for t, c in raw_spot.items()
    }
    for t, count in spot_fleet.items():
        if count > fleet.get(t, 0):
            raise PlanError(
                f"{where}.spot_fleet[{t}]",
                f"{count} spot instances, more than the fleet's {fleet.get(t, 0)}",
                source,
            )
    return StagePlan(
        name=name,
        fleet=fleet,
        batch_size=batch,
        policy=policy,
        base_types=tuple(raw_base),
        spot_fleet=spot_fleet,
        **numbers,
    )


def _envelope(raw: object) -> tuple[tuple[float, ...], tuple[float, ...], str | None]:
    """(windows s, rates qps, None), or two empty tuples and what is wrong (one line) with a
    malformed envelope: windows and rates must be finite numbers > 0, as many of each, the
    windows increasing."""
    if raw is None:
        return (), (), None
    if not isinstance(raw, Mapping):
        return (), (), f"expected an object, got {type(raw).__name__}"
    windows = _positive_numbers("windows_s", raw.get("windows_s"))
    if isinstance(windows, str):
        return (), (), windows
    rates = _positive_numbers("rate_qps", raw.get("rate_qps"))
    if isinstance(rates, str):
        return (), (), rates
    if not windows or len(windows) != len(rates):
        return (), (), f"{len(windows)} windows and {len(rates)} rates"
    if any(later <= earlier for earlier, later in itertools.pairwise(windows)):
        return (), (), "windows_s is not increasing"
    return windows, rates, None


def _positive_numbers(name: str, raw: object) -> tuple[float, ...] | str:
    """``raw`` as finite numbers > 0, or what is wrong with it (one line)."""
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        return f"{name} is not a list"
    numbers = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} holds {value!r}, not a number"
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
        if not (math.isfinite(number) and number > 0):
            return f"{name} holds {value!r}, not a finite number > 0"
        numbers.append(number)
    return tuple(numbers)
