"""Errors of the estimator library.

Every error a user's input can cause derives from :class:`EstimatorError`, so a command line or an
API can turn all of them into a one-line message (exit status 2, or a 4xx) in one place. Each
subclass carries the fields that say what was wrong.
"""

from __future__ import annotations


class EstimatorError(ValueError):
    """Root of the estimator's input errors: the message is one line meant for a user."""


class CatalogError(EstimatorError):
    """An instance catalog file is malformed (missing column, negative price, duplicate type)."""


class UnknownInstanceTypeError(EstimatorError):
    """An instance type name that the catalog (or a profile set) does not know."""

    def __init__(self, instance_type: str, known: list[str] | None = None, where: str = "catalog"):
        self.instance_type = instance_type
        self.known = sorted(known or [])
        hint = f" ({known_types_hint(instance_type, self.known)})" if self.known else ""
        super().__init__(f"unknown instance type {instance_type!r} in the {where}{hint}")


def known_types_hint(name: str, known: list[str]) -> str:
    """``did you mean ...? known: ...``: the close matches to ``name``, then every known type on
    one line, a family of more than three sizes folded to ``g5.* (8)``, so that no family (the
    emulated ``emu.*`` ones) falls off the end of a cut list.

    >>> known_types_hint("emu.cpu.smal", ["emu.cpu.large", "emu.cpu.small", "g5.xlarge"])
    "did you mean 'emu.cpu.small'? known: emu.cpu.large, emu.cpu.small, g5.xlarge"
    >>> known_types_hint("x", [f"g5.{n}xlarge" for n in (2, 4, 8, 12)] + ["local.cpu"])
    'known: g5.* (4), local.cpu'
    """
    import difflib

    families: dict[str, list[str]] = {}
    for type_name in sorted(known):
        families.setdefault(type_name.split(".", 1)[0], []).append(type_name)
    shown = [
        ", ".join(members) if len(members) <= 3 else f"{family}.* ({len(members)})"
        for family, members in families.items()
    ]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
    guess = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"{guess}known: {', '.join(shown)}"


class ProfileError(EstimatorError):
    """A profile file is missing or malformed."""


class UnknownModelError(EstimatorError):
    """A model the profile set has no measurements for."""

    def __init__(self, model: str, known: list[str]):
        self.model = model
        self.known = sorted(known)
        super().__init__(f"unknown model {model!r} (profiles have: {', '.join(self.known)})")


class MissingProfileError(EstimatorError):
    """A (model, instance type) pair that the profile set has no measurements for."""

    def __init__(self, model: str, instance_type: str):
        self.model = model
        self.instance_type = instance_type
        super().__init__(f"no profile for model {model!r} on instance type {instance_type!r}")


class BatchSizeOutOfRangeError(EstimatorError):
    """A batch size below the smallest or above the largest measured one of a profile."""

    def __init__(self, model: str, instance_type: str, batch_size: int, low: int, high: int):
        self.model = model
        self.instance_type = instance_type
        self.batch_size = batch_size
        self.low = low
        self.high = high
        super().__init__(
            f"batch size {batch_size} is outside the profile of {model!r} on {instance_type!r}"
            f" (measured {low}..{high})"
        )


class FleetError(EstimatorError):
    """A fleet string or object that is malformed (``type=count`` with a bad count, duplicates)."""


class TraceError(EstimatorError):
    """A trace that is malformed: missing columns, non-monotonic arrivals, bad batch sizes."""


class WorkloadError(EstimatorError):
    """Bad generator parameters: a non-positive rate or duration, a bad batch-size spec."""


class SimulationError(EstimatorError):
    """A simulation that cannot run as asked (an empty fleet, an unknown policy)."""


class InfeasibleQoSError(EstimatorError):
    """A latency target that no candidate instance type meets for every batch size of the mix.

    ``reach`` maps each type to the largest batch size of the mix up to which it meets the target
    (``None``: not even the smallest).
    """

    def __init__(self, model: str, qos_ms: float, reach: dict[str, int | None]):
        self.model = model
        self.qos_ms = qos_ms
        self.reach = dict(reach)
        shown = ", ".join(
            f"{name} up to {size}" if size is not None else f"{name} at none"
            for name, size in sorted(self.reach.items())
        )
        super().__init__(
            f"no instance type meets QoS {qos_ms:g} ms for model {model!r} at every batch size of"
            f" the mix, so none can serve it alone (within QoS: {shown})"
        )


class BudgetError(EstimatorError):
    """A budget that is not a positive finite number, or that affords no configuration."""

    def __init__(self, message: str, budget_usd_per_hr: float):
        self.budget_usd_per_hr = budget_usd_per_hr
        super().__init__(message)


class SearchSpaceError(EstimatorError):
    """A configuration space too large for what was asked (ranking all of it)."""


class CascadeError(EstimatorError):
    """A cascade, its validation records or a gear plan that is malformed or cannot be built.

    ``field`` is the path of the offending value (``models[1].certainty``, ``thresholds``; empty
    when the whole thing is wrong) and ``source`` the file it came from, when one was read; the
    message is the one line ``source: field: problem``.
    """

    def __init__(self, field: str, problem: str, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        super().__init__(": ".join(part for part in (source, field, problem) if part))


class NoFeasibleGearError(CascadeError):
    """No candidate cascade meets the latency SLO on the placement, not even at the lowest load.

    ``best_latency_ms`` is the lowest simulated tail latency any candidate reached (at a load
    near zero), against ``slo_ms``.
    """

    def __init__(self, slo_ms: float, best_latency_ms: float, best: str) -> None:
        self.slo_ms = slo_ms
        self.best_latency_ms = best_latency_ms
        self.best = best
        super().__init__(
            "gears",
            f"no cascade meets the latency SLO of {slo_ms:g} ms on this placement even at the"
            f" lowest load: the best, {best}, reaches {best_latency_ms:.1f} ms",
        )


class InfeasibleAllocationError(EstimatorError):
    """No allocation of instances to the stages is stable within the budget and the caps.

    ``stage`` names the first stage that no affordable allocation keeps below utilisation 1
    (``None`` when each stage alone can be served but not all of them together).
    """

    def __init__(self, message: str, stage: str | None = None) -> None:
        self.stage = stage
        super().__init__(message)
