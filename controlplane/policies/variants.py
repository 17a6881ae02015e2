"""Model-less queries (INFaaS): a query names its app and its needs; the system picks the variant.

This module owns INFaaS's model-variant selection on arrival of a query (Romero et al.,
"INFaaS", USENIX ATC'21, section 4.1, Algorithm 1) as a pure function: a query states the app
and its requirements (:class:`Requirements`: a latency bound and a minimum accuracy, either
optional) instead of a model; :func:`choose` picks, among the variants the running fleet offers
(:class:`VariantOption`: a single model or a cascade gear, with its predicted latency at the
current load, its accuracy and its cost per query), the cheapest that meets them.

The rule, after Algorithm 1 on one app:

1. The feasible variants are the *active* ones (INFaaS's state machine: neither ``overloaded``,
   serving at its peak throughput, nor ``interfered``, slower than its profile) whose predicted
   latency is within the bound and whose accuracy is at least the minimum.
2. Of those, the cheapest per query (ties: the faster, then the more accurate, then by name).
3. When none is feasible, the *closest offer* (INFaaS's ``suggestVariant``: "a variant that can
   achieve the closest target accuracy and/or latency"): the variant of least total relative
   shortfall, (latency - bound) / bound + (minimum - accuracy) / minimum over the requirements it
   misses, an inactive variant counting only when it is otherwise feasible and nothing active
   comes as close. The result says what was missed and by how much.

:func:`gear_options` turns a gear plan into options at the current load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from controlplane.policies.gears import GearPlan
from estimator.errors import CascadeError

__all__ = [
    "Requirements",
    "VariantChoice",
    "VariantOption",
    "VariantState",
    "choose",
    "gear_options",
    "ms_text",
    "offer_text",
    "percent_places",
]

VariantState = Literal["active", "overloaded", "interfered"]
_STATES = ("active", "overloaded", "interfered")


@dataclass(frozen=True, slots=True)
class Requirements:
    """What a model-less query asks for: its app, a latency bound (ms) and a minimum accuracy
    in (0, 1]; ``None`` leaves that one free."""

    app: str
    latency_ms: float | None = None
    min_accuracy: float | None = None

    def __post_init__(self) -> None:
        if self.latency_ms is not None and not (
            math.isfinite(self.latency_ms) and self.latency_ms > 0
        ):
            raise CascadeError("latency_ms", f"must be a number > 0, got {self.latency_ms!r}")
        if self.min_accuracy is not None and not 0 < self.min_accuracy <= 1:
            raise CascadeError("min_accuracy", f"must be in (0, 1], got {self.min_accuracy!r}")

    def describe(self) -> str:
        parts = []
        if self.latency_ms is not None:
            parts.append(f"latency <= {self.latency_ms:g} ms")
        if self.min_accuracy is not None:
            parts.append(f"accuracy >= {100 * self.min_accuracy:.2f}%")
        return " and ".join(parts) or "no requirement"


@dataclass(frozen=True, slots=True)
class VariantOption:
    """A variant the running fleet offers: a single model or a cascade gear (``kind``), its
    predicted latency at the current load (ms), its accuracy in [0, 1], its cost per query
    (USD) and its INFaaS state."""

    name: str
    predicted_latency_ms: float
    accuracy: float
    cost_usd_per_query: float
    kind: str = "model"
    state: VariantState = "active"

    def __post_init__(self) -> None:
        if not self.name:
            raise CascadeError("name", "a variant needs a name")
        if math.isnan(self.predicted_latency_ms) or self.predicted_latency_ms < 0:
            raise CascadeError(
                f"{self.name}.predicted_latency_ms",
                f"must be >= 0 (infinity: cannot keep up), got {self.predicted_latency_ms!r}",
            )
        if not 0 <= self.accuracy <= 1:
            raise CascadeError(f"{self.name}.accuracy", f"must be in [0, 1], got {self.accuracy!r}")
        if not (math.isfinite(self.cost_usd_per_query) and self.cost_usd_per_query >= 0):
            raise CascadeError(
                f"{self.name}.cost_usd_per_query", f"must be >= 0, got {self.cost_usd_per_query!r}"
            )
        if self.state not in _STATES:
            raise CascadeError(f"{self.name}.state", f"must be one of {', '.join(_STATES)}")


@dataclass(frozen=True, slots=True)
class VariantChoice:
    """What :func:`choose` found: the variant (the cheapest that meets the requirements, or the
    closest offer), whether it meets them, by how much it misses each (0 when met: ms over the
    bound, accuracy points under the minimum), and a one-line message."""

    option: VariantOption
    met: bool
    latency_over_ms: float
    accuracy_short: float
    message: str


def _shortfall(option: VariantOption, needs: Requirements) -> tuple[float, float, float]:
    """(ms over the bound, accuracy under the minimum, total relative shortfall)."""
    over = 0.0
    short = 0.0
    relative = 0.0
    if needs.latency_ms is not None and option.predicted_latency_ms > needs.latency_ms:
        over = option.predicted_latency_ms - needs.latency_ms
        relative += over / needs.latency_ms
    if needs.min_accuracy is not None and option.accuracy < needs.min_accuracy:
        short = needs.min_accuracy - option.accuracy
        relative += short / needs.min_accuracy
    return over, short, relative


def choose(needs: Requirements, options: Sequence[VariantOption]) -> VariantChoice:
    """The cheapest variant that meets ``needs``, or the closest offer with what it misses (see
    the module docstring).

    >>> options = [VariantOption("large", 40.0, 0.99, 2e-6), VariantOption("tiny", 5.0, 0.93, 1e-7)]
    >>> choose(Requirements("digits", latency_ms=50, min_accuracy=0.95), options).option.name
    'large'
    >>> missed = choose(Requirements("digits", latency_ms=20, min_accuracy=0.95), options)
    >>> missed.met, missed.option.name, round(missed.accuracy_short, 4)
    (False, 'tiny', 0.02)

    Raises:
        CascadeError: no options.
    """
    if not options:
        raise CascadeError("options", f"app {needs.app!r} offers no variant")
    scored = [(option, *_shortfall(option, needs)) for option in options]
    feasible = [
        item for item in scored if item[0].state == "active" and item[1] == 0 and item[2] == 0
    ]
    if feasible:
        best, _, _, _ = min(
            feasible,
            key=lambda item: (
                item[0].cost_usd_per_query,
                item[0].predicted_latency_ms,
                -item[0].accuracy,
                item[0].name,
            ),
        )
        return VariantChoice(
            best,
            True,
            0.0,
            0.0,
            f"{needs.app}: {best.kind} {best.name} meets {needs.describe()}:"
            f" {_numbers(best)}, ${best.cost_usd_per_query:.3g} per query (the cheapest of"
            f" {len(feasible)} that do)",
        )
    # Inactive variants that would meet the numbers come after every active one.
    option, over, short, _ = min(
        scored,
        key=lambda item: (
            item[0].state != "active",
            item[3],
            item[0].cost_usd_per_query,
            item[0].name,
        ),
    )
    state = "" if option.state == "active" else f", but it is {option.state}"
    return VariantChoice(
        option,
        False,
        over,
        short,
        f"{needs.app}: no variant meets {needs.describe()} on the running fleet; closest offer:"
        f" {offer_text(option, needs, over, short)}{state}",
    )


def offer_text(
    option: VariantOption, needs: Requirements, over: float, short: float, *, fastest: bool = False
) -> str:
    """A closest offer as a refusal names it: its kind and name, its latency (``over`` the bound
    or meeting it) and its accuracy (``short`` of the floor or meeting it) where ``needs`` bound
    them. ``fastest``: the latency is the least any fleet could give (said "at the fastest", and
    only where bounded); else the running fleet's, always said.

    >>> option = VariantOption("tiny", 12.0, 0.961, 1e-6)
    >>> offer_text(option, Requirements("digits", 10.0, 0.97), 2.0, 0.009)
    'model tiny at 12 ms (2 ms over) with accuracy 96.10% (0.90 points short)'
    >>> offer_text(option, Requirements("digits", None, 0.97), 0.0, 0.009, fastest=True)
    'model tiny with accuracy 96.10% (0.90 points short)'
    """
    missed = []
    if needs.latency_ms is not None:
        missed.append(
            f"at {ms_text(option.predicted_latency_ms)} ms"
            + (" at the fastest" if fastest else "")
            + (f" ({ms_text(over)} ms over)" if over > 0 else " (meets)")
        )
    elif not fastest:
        missed.append(f"at {ms_text(option.predicted_latency_ms)} ms")
    if needs.min_accuracy is not None and option.accuracy == 0:
        # 0 is the accuracy of a variant without validation records: unknown, not measured 0.
        missed.append("with its accuracy unknown (the app names no validation records)")
    elif needs.min_accuracy is not None:
        places = percent_places(option.accuracy, needs.min_accuracy) if short > 0 else 2
        missed.append(
            f"with accuracy {100 * option.accuracy:.{places}f}%"
            + (f" ({100 * short:.{places}f} points short)" if short > 0 else " (meets)")
        )
    return f"{option.kind} {option.name} {' '.join(missed)}"


def percent_places(accuracy: float, minimum: float) -> int:
    """Decimal places (2 or more) at which an accuracy under ``minimum`` shows as under it, with
    a shortfall above 0: at 2, 875/900 under a minimum of 0.97223 read 'accuracy 97.22% (0.00
    points short)'."""
    places = 2
    while places < 6 and (
        f"{100 * accuracy:.{places}f}" == f"{100 * minimum:.{places}f}"
        or float(f"{100 * (minimum - accuracy):.{places}f}") == 0
    ):
        places += 1
    return places


def _numbers(option: VariantOption) -> str:
    return f"{ms_text(option.predicted_latency_ms)} ms, accuracy {100 * option.accuracy:.2f}%"


def ms_text(value: float) -> str:
    """Milliseconds as a reader takes them: three figures below 1,000, whole ones with commas
    above (``.3g`` wrote 6,900 ms as ``6.9e+03``).

    >>> ms_text(0.4567), ms_text(33.54), ms_text(6912.3)
    ('0.457', '33.5', '6,912')
    """
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def gear_options(
    plan: GearPlan,
    load_qps: float,
    prices_usd_per_hr: Mapping[str, float],
    *,
    overloaded_share: float = 1.0,
) -> list[VariantOption]:
    """The plan's options as variants at ``load_qps``: predicted latency from the option's
    simulated probes (infinite past its highest feasible one), its validation accuracy, and its
    cost per query, the placement's price per second shared over the load it serves
    (sum_t n_t P_t / 3600 / max(load, 1 qps)) weighted by its compute per query against the
    plan's cheapest option. An option is ``overloaded`` when the load reaches ``overloaded_share``
    of its max sustainable QPS.
    """
    if not (math.isfinite(load_qps) and load_qps >= 0):
        raise CascadeError("load_qps", f"must be a finite number >= 0, got {load_qps!r}")
    fleet_usd_per_s = plan.placement.cost_usd_per_hr(prices_usd_per_hr) / 3600.0
    cheapest = min(o.compute_ms_per_query for o in plan.options) or 1.0
    per_query = fleet_usd_per_s / max(load_qps, 1.0)
    options = []
    for option in plan.options:
        state: VariantState = (
            "overloaded" if load_qps >= overloaded_share * option.max_qps else "active"
        )
        options.append(
            VariantOption(
                name=option.cascade.label,
                predicted_latency_ms=option.tail_ms_at(load_qps),
                accuracy=option.quality.accuracy,
                cost_usd_per_query=per_query * option.compute_ms_per_query / cheapest,
                kind="gear" if len(option.cascade.models) > 1 else "model",
                state=state,
            )
        )
    return options
