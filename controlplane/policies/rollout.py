"""A rollout of a new model version into a running app: its states, its steps, which queries
the new version answers, what it costs, and the judgement after each interval. Pure: no I/O, no
clock (the caller passes the times).

A rollout moves one model of an app from its pinned version (``from_version``) to another
(``to_version``) through ``steps``, shares of the queries answered by the new version
(``0.05, 0.25, 0.5, 1.0`` by default). With ``shadow`` it first runs a *shadow* step: share 0, but
every query also goes to the new version, whose answer is compared with the old one's and thrown
away. Each step lasts at least ``interval_s``; then :func:`judge` promotes it to the next step,
holds it (too few queries measured yet), or rolls it back; a breach of a threshold rolls back at
once, without waiting for the interval's end (Flagger's and Argo Rollouts' analysis runs the
same way: a failed check aborts, a passed interval advances).

The states and their moves are one table (:data:`TRANSITIONS`), as the instance lifecycle's:

>>> check_rollout_transition("running", "paused")
>>> check_rollout_transition("promoted", "running")
Traceback (most recent call last):
...
controlplane.errors.InvalidRolloutTransitionError: a rollout cannot go from 'promoted' to 'running'

Which query the new version answers is a function of the request's id alone (:func:`bucket`, a
SHA-256 of the id read as a number in [0, 1)), so a client can tell, and reproduce, which of its
queries went where: the query goes to the new version when ``bucket(id) < step_share``. The
buckets of a step are a superset of the previous step's (the shares grow), so a query id that
was on the new version stays there as the rollout advances.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from controlplane.errors import InvalidValueError
from controlplane.policies.cascade_choice import ACCURACY_TOLERANCE
from controlplane.policies.lifecycle import PROFILE_REQUEST_PREFIX
from controlplane.policies.rollout_states import (
    ACTIVE_STATES,
    TRANSITIONS,
    RolloutState,
    check_rollout_transition,
)
from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    DEFAULT_SPLIT_SEED,
    DEFAULT_THRESHOLD_GRID,
    ValidationRecords,
    candidate_cascades,
    evaluate,
)

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_STEPS",
    "TRANSITIONS",
    "Judgement",
    "RolloutState",
    "ThresholdChoice",
    "Thresholds",
    "Verdict",
    "VersionFigures",
    "bucket",
    "check_rollout_transition",
    "extra_fleet",
    "judge",
    "parse_steps",
    "rederive_thresholds",
    "rollout_request_prefix",
    "routed_to_new",
    "step_fleet",
    "step_shares",
]


DEFAULT_STEPS: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
# Two minutes an interval, as Flagger's default analysis interval times its iterations.
DEFAULT_INTERVAL_S = 120.0


def rollout_request_prefix(app: str, rollout_id: int) -> str:
    """The request ids of a rollout's workers start with this. It starts with the profile
    workers' prefix (:data:`controlplane.policies.lifecycle.PROFILE_REQUEST_PREFIX`) on purpose:
    the reconciler keeps them out of the fleet but in the budget, and ends them once their
    owner (the rollout loop, which touches their rows every tick) stops touching them.

    >>> rollout_request_prefix("wine", 3)
    'profile:rollout-wine-3-'
    """
    return f"{PROFILE_REQUEST_PREFIX}rollout-{app[:20]}-{rollout_id}-"


def rollout_of(app: str, request_id: str) -> int | None:
    """The rollout whose worker the instance launched under ``request_id`` for ``app`` is
    (None: not a rollout's).

    >>> rollout_of("wine", "profile:rollout-wine-3-emu.cpu.small-1"), rollout_of("wine", "w-1")
    (3, None)
    """
    head = f"{PROFILE_REQUEST_PREFIX}rollout-{app[:20]}-"
    if not request_id.startswith(head):
        return None
    number = request_id[len(head) :].split("-", 1)[0]
    return int(number) if number.isdigit() else None


def parse_steps(text: str) -> tuple[float, ...]:
    """``--steps 5,25,50,100`` (percentages of the queries) as shares, checked: increasing,
    each in (0, 100], the last 100.

    >>> parse_steps("5,25,50,100")
    (0.05, 0.25, 0.5, 1.0)
    >>> parse_steps("50,20,100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    controlplane.errors.InvalidValueError: steps: must increase, ... the last 100; got 50,20,100
    """
    try:
        percents = [float(part) for part in text.split(",")]
    except ValueError:
        raise InvalidValueError(
            "steps", f"expected percentages like 5,25,50,100; got {text}"
        ) from None
    return step_shares([p / 100.0 for p in percents], shown=text)


def step_shares(shares: Sequence[float], *, shown: str | None = None) -> tuple[float, ...]:
    """``shares`` checked: finite, increasing, each in (0, 1], the last 1 (a rollout ends with
    every query on the new version). Each is kept to six places, and checked as kept (a share
    of 1e-300 would be stored as 0: a shadow step nobody asked for)."""
    values = [round(float(s), 6) if math.isfinite(float(s)) else float(s) for s in shares]
    ok = (
        bool(values)
        and all(math.isfinite(v) and 0.0 < v <= 1.0 for v in values)
        and all(a < b for a, b in itertools.pairwise(values))
        and math.isclose(values[-1], 1.0)
    )
    if not ok:
        if shown is not None:  # the CLI's percentages
            raise InvalidValueError(
                "steps", f"must increase, each in (0, 100], the last 100; got {shown}"
            )
        given = ",".join(f"{v:g}" for v in values)
        raise InvalidValueError(
            "steps",
            f"shares of the traffic: must increase, each in (0, 1], the last 1; got {given}",
        )
    return tuple(values)


def bucket(request_id: str) -> float:
    """The request's place in [0, 1): the first 8 bytes of SHA-256(``request_id``) over 2^64.

    >>> bucket("q-1") == bucket("q-1"), 0.0 <= bucket("q-1") < 1.0
    (True, True)
    """
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def routed_to_new(request_id: str, share: float) -> bool:
    """Whether the query ``request_id`` goes to the new version at ``share``."""
    return share > 0.0 and bucket(request_id) < share


def extra_fleet(
    stage_fleet: Mapping[str, int], prices_usd_per_hr: Mapping[str, float], share: float
) -> dict[str, int]:
    """The instances the new version needs at ``share`` of the queries (1.0 in shadow mode:
    it sees every query): ceil(share x count) of each type of the model's stage fleet, and at
    least one instance, of the cheapest type, when that rounds to nothing. A stage with no
    planned fleet gets one instance of the cheapest priced type.

    >>> extra_fleet({"a": 4, "b": 1}, {"a": 1.0, "b": 3.0}, 0.25)
    {'a': 1, 'b': 1}
    >>> extra_fleet({}, {"a": 1.0, "b": 3.0}, 0.05)
    {'a': 1}
    """
    fleet = {t: math.ceil(share * n - 1e-9) for t, n in stage_fleet.items() if n > 0}
    fleet = {t: n for t, n in fleet.items() if n > 0}
    if not fleet:
        candidates = [t for t in stage_fleet if t in prices_usd_per_hr] or list(prices_usd_per_hr)
        if not candidates:
            return {}
        cheapest = min(candidates, key=lambda t: (prices_usd_per_hr[t], t))
        fleet = {cheapest: 1}
    return dict(sorted(fleet.items()))


def step_fleet(
    stages: Mapping[str, int],
    prices_usd_per_hr: Mapping[str, float],
    shares: Sequence[float],
    index: int,
    granted: Mapping[str, int],
) -> dict[str, int]:
    """A rollout's extra instances at step ``index`` of ``shares``: the stage fleet ``stages``
    at the step's share (:func:`extra_fleet`; a shadow step, share 0, mirrors every query: the
    whole stage fleet), never fewer of a type than ``granted`` already (a rollout's fleet only
    grows: its workers of a step keep serving the next).

    >>> step_fleet({"a": 4}, {"a": 1.0}, (0.05, 0.25, 0.5, 1.0), 0, {})
    {'a': 1}
    >>> step_fleet({"a": 4}, {"a": 1.0}, (0.05, 0.25, 0.5, 1.0), 2, {"a": 1})
    {'a': 2}
    >>> step_fleet({"a": 4}, {"a": 1.0}, (0.0, 0.5, 1.0), 1, {"a": 4})  # after a shadow step
    {'a': 4}
    """
    share = float(shares[index]) or 1.0
    wanted = extra_fleet(stages, prices_usd_per_hr, share)
    for t, n in granted.items():
        wanted[t] = max(wanted.get(t, 0), int(n))
    return dict(sorted(wanted.items()))


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When the new version fails. ``max_p99_ms`` None: the app's SLO. ``max_error_share``: of
    the queries sent to the new version, the share that failed. ``min_agreement_share``: in
    shadow, the share of compared answers (sample by sample) equal to the old version's.
    ``min_queries``: how many of the new version's queries a step needs before it may advance
    (a P99 of five queries says little). ``min_accuracy`` (None: not judged): the share of its
    labelled samples (queries naming validation samples) answered with their label."""

    max_p99_ms: float | None = None
    max_error_share: float = 0.01
    min_agreement_share: float = 0.95
    min_queries: int = 50
    min_accuracy: float | None = None

    def __post_init__(self) -> None:
        if self.max_p99_ms is not None and not (
            math.isfinite(self.max_p99_ms) and self.max_p99_ms > 0
        ):
            raise InvalidValueError("max_p99_ms", f"must be a number > 0, got {self.max_p99_ms}")
        if not 0.0 <= self.max_error_share <= 1.0:
            raise InvalidValueError(
                "max_error_share", f"must be in [0, 1], got {self.max_error_share}"
            )
        if not 0.0 <= self.min_agreement_share <= 1.0:
            raise InvalidValueError(
                "min_agreement_share", f"must be in [0, 1], got {self.min_agreement_share}"
            )
        if self.min_queries < 1:
            raise InvalidValueError("min_queries", f"must be >= 1, got {self.min_queries}")
        if self.min_accuracy is not None and not 0.0 <= self.min_accuracy <= 1.0:
            raise InvalidValueError("min_accuracy", f"must be in [0, 1], got {self.min_accuracy}")

    def p99_limit_ms(self, slo_ms: float) -> float:
        return self.max_p99_ms if self.max_p99_ms is not None else slo_ms

    def to_json(self) -> dict[str, float | int | None]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """One version's figures over a step, as the client saw them: queries answered or failed,
    the answered ones' P99 (None: none answered), in shadow the samples compared and agreed,
    and the samples that carried a validation sample id (``labelled``) and were answered with
    its label (``correct``)."""

    queries: int = 0
    errors: int = 0
    p99_ms: float | None = None
    compared: int = 0
    agreed: int = 0
    labelled: int = 0
    correct: int = 0

    @property
    def error_share(self) -> float:
        return self.errors / self.queries if self.queries else 0.0

    @property
    def agreement_share(self) -> float | None:
        return self.agreed / self.compared if self.compared else None

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.labelled if self.labelled else None

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "queries": self.queries,
            "errors": self.errors,
            "error_share": self.error_share,
            "p99_ms": self.p99_ms,
            "compared": self.compared,
            "agreed": self.agreed,
            "agreement_share": self.agreement_share,
            "labelled": self.labelled,
            "correct": self.correct,
            "accuracy": self.accuracy,
        }


class Verdict(StrEnum):
    PROMOTE = "promote"  # on to the next step
    COMPLETE = "complete"  # the last step passed: the new version is the app's
    HOLD = "hold"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    reason: str


# The confidence with which a new version's error share is found over its limit before
# ``min_queries`` (the normal quantile of a one-sided 97.5% bound).
ERROR_EVIDENCE_Z = 1.96


def error_share_floor(errors: int, queries: int, z: float = ERROR_EVIDENCE_Z) -> float:
    """The lower Wilson score bound of an error share of ``errors`` in ``queries``: the least
    share the sample leaves likely (0 without a query).

    >>> round(error_share_floor(2, 3), 3), round(error_share_floor(1, 1), 3)
    (0.208, 0.207)
    >>> error_share_floor(0, 10), error_share_floor(0, 0)
    (0.0, 0.0)
    """
    if queries <= 0 or errors <= 0:
        return 0.0
    n = float(queries)
    share = errors / n
    z2 = z * z
    centre = share + z2 / (2.0 * n)
    spread = z * math.sqrt(share * (1.0 - share) / n + z2 / (4.0 * n * n))
    return max(0.0, (centre - spread) / (1.0 + z2 / n))


def error_share_over(figures: VersionFigures, thresholds: Thresholds) -> bool:
    """Whether the new version's error share is over ``max_error_share`` on the evidence: with
    ``min_queries`` sent to it, its share; before that, the least share its sample leaves likely
    (:func:`error_share_floor`), so that two errors in its first three queries do not decide a
    limit of a half, while one error in the first query still decides the default 1%. (A failed
    query is answered by the old version in a canary step, and in shadow the client had the
    old version's answer: waiting for the evidence costs the clients nothing. It had rolled
    back on the share of any sample.)

    >>> t = Thresholds(max_error_share=0.5, min_queries=20)
    >>> early, sure = VersionFigures(3, 2, None), VersionFigures(20, 11, None)
    >>> error_share_over(early, t), error_share_over(sure, t)
    (False, True)
    >>> error_share_over(VersionFigures(1, 1, None), Thresholds())
    True
    """
    if figures.queries <= 0 or figures.error_share <= thresholds.max_error_share:
        return False
    if figures.queries >= thresholds.min_queries:
        return True
    return error_share_floor(figures.errors, figures.queries) > thresholds.max_error_share


def judge(
    *,
    figures: VersionFigures,
    shadow_step: bool,
    last_step: bool,
    elapsed_s: float,
    interval_s: float,
    slo_ms: float,
    thresholds: Thresholds,
) -> Judgement:
    """What a step of a rollout comes to, from the new version's ``figures`` over the step
    (``elapsed_s`` of its ``interval_s``):

    1. roll back at once when its error share is over ``max_error_share`` on the evidence
       (:func:`error_share_over`: with ``min_queries`` sent, or before that by the least share
       its sample leaves likely), when, with at
       least ``min_queries`` answered, its P99 is over the limit (``max_p99_ms``, else the
       SLO), or when, in the shadow step with ``min_queries`` compared, its agreement with the
       old version is under ``min_agreement_share``, or when, with ``min_accuracy`` set and at
       least ``min_queries`` labelled samples answered, its accuracy is under it: the share of
       traffic it harms is no longer worth the interval;
    2. hold until the interval is over;
    3. hold while fewer than ``min_queries`` were measured (answered, or compared in shadow):
       a quiet app stays on its step rather than advance on no evidence;
    4. else promote to the next step, or complete after the last.

    >>> t = Thresholds(min_queries=10)
    >>> judge(figures=VersionFigures(100, 0, 80.0), shadow_step=False, last_step=False,
    ...       elapsed_s=130, interval_s=120, slo_ms=100, thresholds=t).verdict
    <Verdict.PROMOTE: 'promote'>
    >>> judge(figures=VersionFigures(100, 0, 180.0), shadow_step=False, last_step=False,
    ...       elapsed_s=30, interval_s=120, slo_ms=100, thresholds=t).verdict
    <Verdict.ROLL_BACK: 'roll_back'>
    """
    limit_ms = thresholds.p99_limit_ms(slo_ms)
    if error_share_over(figures, thresholds):
        return Judgement(
            Verdict.ROLL_BACK,
            f"error share {figures.error_share:.3f} ({figures.errors} of {figures.queries}"
            f" queries) over the limit {thresholds.max_error_share:g}",
        )
    answered = figures.queries - figures.errors
    if (
        answered >= thresholds.min_queries
        and figures.p99_ms is not None
        and figures.p99_ms > limit_ms
    ):
        return Judgement(
            Verdict.ROLL_BACK,
            f"P99 {figures.p99_ms:.1f} ms over the limit {limit_ms:g} ms"
            f" ({answered} queries answered)",
        )
    agreement = figures.agreement_share
    if (
        shadow_step
        and agreement is not None
        and figures.compared >= thresholds.min_queries
        and agreement < thresholds.min_agreement_share
    ):
        return Judgement(
            Verdict.ROLL_BACK,
            f"agreement with the old version {agreement:.3f} ({figures.agreed} of"
            f" {figures.compared} samples) under the limit {thresholds.min_agreement_share:g}",
        )
    accuracy = figures.accuracy
    if (
        thresholds.min_accuracy is not None
        and accuracy is not None
        and figures.labelled >= thresholds.min_queries
        and accuracy < thresholds.min_accuracy
    ):
        return Judgement(
            Verdict.ROLL_BACK,
            f"accuracy {accuracy:.3f} ({figures.correct} of {figures.labelled} labelled samples)"
            f" under the limit {thresholds.min_accuracy:g}",
        )
    if elapsed_s < interval_s:
        return Judgement(Verdict.HOLD, f"interval not over ({elapsed_s:.0f} of {interval_s:g} s)")
    measured = figures.compared if shadow_step else answered
    if measured < thresholds.min_queries:
        what = "samples compared" if shadow_step else "queries answered"
        return Judgement(
            Verdict.HOLD,
            f"only {measured} {what} by the new version, {thresholds.min_queries} needed",
        )
    p99 = "no P99" if figures.p99_ms is None else f"P99 {figures.p99_ms:.1f} ms"
    checks = f"{p99} <= {limit_ms:g} ms, error share {figures.error_share:.3f}"
    if shadow_step and agreement is not None:
        checks += f", agreement {agreement:.3f}"
    if thresholds.min_accuracy is not None and accuracy is not None:
        checks += f", accuracy {accuracy:.3f}"
    if last_step:
        return Judgement(Verdict.COMPLETE, f"last step passed ({checks})")
    return Judgement(Verdict.PROMOTE, f"step passed ({checks})")


@dataclass(frozen=True, slots=True)
class ThresholdChoice:
    """A cascade's thresholds re-derived for a new member version: ``thresholds``, their
    accuracy on the choose split (``in_sample_accuracy``) and on the score split the choice never
    saw (``held_out_accuracy``, of ``held_out_samples``), and whether it reaches the floor the
    rule asked for (``meets_floor``; else the most accurate thresholds of the chain)."""

    thresholds: tuple[float, ...]
    in_sample_accuracy: float
    held_out_accuracy: float
    held_out_samples: int
    compute_ms_per_query: float
    meets_floor: bool

    def to_json(self) -> dict[str, object]:
        return {
            "thresholds": list(self.thresholds),
            "in_sample_accuracy": self.in_sample_accuracy,
            "held_out_accuracy": self.held_out_accuracy,
            "held_out_samples": self.held_out_samples,
            "compute_ms_per_query": self.compute_ms_per_query,
            "meets_floor": self.meets_floor,
        }


def rederive_thresholds(
    records: ValidationRecords,
    chain: Sequence[str],
    compute_ms: Mapping[str, float],
    *,
    accuracy_floor: float | None = None,
    grid: Sequence[float] = DEFAULT_THRESHOLD_GRID,
    tolerance: float = ACCURACY_TOLERANCE,
    share: float = DEFAULT_CHOOSE_SHARE,
    seed: int = DEFAULT_SPLIT_SEED,
) -> ThresholdChoice:
    """The thresholds of the cascade ``chain`` (its order kept) for ``records`` of its members,
    the new version's among them, by the held-out protocol (docs/cascades.md): on the *choose*
    split, every combination of ``grid`` at the chain's stages is evaluated (accuracy, and
    compute per query = sum over stages of the share reaching it x its ``compute_ms``); the
    cheapest whose accuracy is at least the floor (the most accurate member alone minus
    ``tolerance`` -- :func:`controlplane.policies.cascade_choice.best_point`'s rule -- and at
    least ``accuracy_floor`` when given) wins, else the most accurate; it is then scored on the
    *score* split.

    >>> from estimator.cascades import synthetic_validation
    >>> import numpy as np
    >>> records = synthetic_validation(np.random.default_rng(0), [0.8, 0.95], n_samples=400)
    >>> choice = rederive_thresholds(records, records.models, {records.models[0]: 1.0,
    ...     records.models[1]: 10.0}, grid=(0.2, 0.5, 0.8))
    >>> len(choice.thresholds), 0.0 <= choice.held_out_accuracy <= 1.0
    (1, True)
    """
    choose, score = records.split(share, seed)
    models = tuple(chain)
    top = max(choose.model_accuracy(m) for m in models)
    floor = top - tolerance - 1e-12
    if accuracy_floor is not None:
        floor = max(floor, accuracy_floor - 1e-12)
    scored = []
    for cascade in candidate_cascades([models], grid):
        quality = evaluate(cascade, choose)
        compute = sum(
            r * float(compute_ms[m]) for m, r in zip(models, quality.reach_share, strict=True)
        )
        scored.append((cascade, quality.accuracy, compute))
    eligible = [s for s in scored if s[1] >= floor]
    if eligible:
        cascade, accuracy, compute = min(eligible, key=lambda s: (s[2], -s[1]))
    else:
        cascade, accuracy, compute = max(scored, key=lambda s: (s[1], -s[2]))
    return ThresholdChoice(
        tuple(float(h) for h in cascade.thresholds),
        float(accuracy),
        float(evaluate(cascade, score).accuracy),
        int(score.n_samples),
        float(compute),
        bool(eligible),
    )
