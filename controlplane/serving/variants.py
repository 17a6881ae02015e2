"""The variants an app offers now, and the one a model-less query gets (INFaaS).

A variant is a cascade the app's stages can serve: the app's own cascade, the gear in force and
each of its models alone. :class:`AppVariants` owns what each is worth now:

- its **quality** on the validation records (accuracy on their held-out half, the figure the
  plan reports, and the share of samples that reach each of its stages:
  :func:`estimator.cascades.evaluate`); without records, accuracy 0 (unknown) and every stage
  reached;
- its **load** (:meth:`AppVariants.loads`: per stage it reaches, the backlog, the capacity at the
  gear's batch cap, or at one query a call where the stage's policy sends each query alone
  (:meth:`~controlplane.serving.stages.ServingStage.call_cap`), and the fastest service time, as
  :class:`~controlplane.serving.admission.StageLoad`), which admission control judges and from
  which its latency is predicted (:func:`~controlplane.serving.admission.predicted_latency_ms`);
- its **cost** per query, the reach-weighted cheapest price per sample of each stage;
- its **INFaaS state** (:mod:`controlplane.serving.states`): *interfered* when every healthy
  worker of a stage it reaches is interfered, else *overloaded* when a stage it reaches cannot
  drain its backlog within the SLO, else *active*.

:meth:`AppVariants.choose` gives a model-less query the cheapest variant that meets its
requirements (:func:`controlplane.policies.variants.choose`), among those whose every model a
healthy worker serves first; when none that is *active* meets them, the cheapest served one that
is *overloaded* or *interfered* only and otherwise meets them, an interfered one at its latency
as slowed (admission control then judges the query at its queue: a 429 to try again where it
cannot serve it in time); else a
:class:`~controlplane.errors.RequirementsUnmetError` naming the closest offer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from controlplane.errors import NoServingInstanceError, RequirementsUnmetError
from controlplane.policies.variants import (
    Requirements,
    VariantOption,
    VariantState,
    choose,
    offer_text,
)
from controlplane.serving.admission import StageLoad, predicted_latency_ms
from controlplane.serving.config import AppConfig, ServingGear, batch_cap
from controlplane.serving.stages import LatencyTable, ServingStage
from controlplane.serving.states import StateTracker, is_overloaded
from estimator.cascades import Cascade, ValidationRecords, evaluate

__all__ = ["AppVariants", "cost_usd_per_sample"]


def cost_usd_per_sample(stage: ServingStage, prices_usd_per_hr: Mapping[str, float]) -> float:
    """The cheapest price of one sample on the stage's instance types (its mean service time at
    batch 1 times the type's price; 0 when no type has a price)."""
    costs = [
        latency.ms(1) / 3.6e6 * prices_usd_per_hr[t]
        for t, latency in stage.latency.items()
        if t in prices_usd_per_hr
    ]
    return min(costs, default=0.0)


class AppVariants:
    """The variants of one app's configuration over its live stages (see the module docstring);
    made anew when the configuration changes (it caches each cascade's quality)."""

    __slots__ = ("_quality", "_score", "config", "stages", "tracker")

    def __init__(
        self, config: AppConfig, stages: Mapping[str, ServingStage], tracker: StateTracker
    ) -> None:
        self.config = config
        self.stages = stages
        self.tracker = tracker
        self._quality: dict[Cascade, tuple[float, tuple[float, ...]]] = {}
        self._score: ValidationRecords | None = None  # the held-out half, split once

    def reach(self, cascade: Cascade) -> tuple[float, tuple[float, ...]]:
        """(accuracy, reach share per stage) of ``cascade`` on the validation records; without
        records, accuracy 0 (unknown) and every stage reached. The accuracy is the held-out one
        (on the *score* half of the records, docs/cascades.md, "The held-out protocol"), the
        figure plans, gears and an SLO's accuracy floor use: the spec's thresholds may have been
        chosen on the other half. The reach shares are over every record."""
        found = self._quality.get(cascade)
        if found is None:
            records = self.config.validation
            if records is not None and all(m in records.models for m in cascade.models):
                quality = evaluate(cascade, records)
                if self._score is None:
                    self._score = records.split()[1]
                score = self._score
                accuracy = quality.accuracy
                if score.n_samples:
                    accuracy = evaluate(cascade, score).accuracy
                found = (accuracy, quality.reach_share)
            else:
                found = (0.0, (1.0,) * len(cascade.models))
            self._quality[cascade] = found
        return found

    def loads(
        self, cascade: Cascade, samples: int, gear: ServingGear, now_s: float
    ) -> list[StageLoad]:
        """What each stage of ``cascade`` faces at ``now_s`` for a query of ``samples`` samples
        under ``gear``'s batch caps (every model of the cascade must have a stage)."""
        _, reach = self.reach(cascade)
        loads = []
        for model, share in zip(cascade.models, reach, strict=True):
            stage = self.stages[model]
            n = max(math.ceil(share * samples), 1)
            cap = stage.call_cap(batch_cap(self.config, model, gear), now_s)
            capacity, fastest = stage.rates(n, cap)
            backlog = stage.queued_samples + stage.in_service_samples
            wait = stage.wait_ms(cap, now_s) if share > 0 else 0.0
            loads.append(StageLoad(backlog, capacity, fastest, share, wait))
        return loads

    def options(
        self, gear: ServingGear, samples: int, now_s: float
    ) -> list[tuple[VariantOption, Cascade]]:
        """The variants offered now under ``gear`` (the gear in force), each with its cascade:
        predicted latency, accuracy, cost per query and state (see the module docstring)."""
        config = self.config
        stages = self.stages
        options = []
        for cascade in self.cascades(gear):
            if not all(stages[m].slots for m in cascade.models):
                continue
            accuracy, reach = self.reach(cascade)
            loads = self.loads(cascade, samples, gear, now_s)
            cost = 0.0
            for model, share in zip(cascade.models, reach, strict=True):
                cost += share * cost_usd_per_sample(stages[model], config.prices_usd_per_hr)
            options.append(
                (
                    VariantOption(
                        name=cascade.label,
                        predicted_latency_ms=predicted_latency_ms(loads),
                        accuracy=accuracy,
                        cost_usd_per_query=cost * samples,
                        kind="gear" if len(cascade.models) > 1 else "model",
                        state=self.state(cascade, loads, now_s),
                    ),
                    cascade,
                )
            )
        return options

    def cascades(self, gear: ServingGear) -> list[Cascade]:
        """The cascades the app's stages can serve under ``gear``, each once: its own cascade,
        the gear's and each of its models alone (whether or not a worker serves them now)."""
        config, found, seen = self.config, [], set()
        for cascade in (config.cascade, gear.cascade, *(Cascade((m,), ()) for m in config.models)):
            if cascade.label not in seen and all(m in self.stages for m in cascade.models):
                seen.add(cascade.label)
                found.append(cascade)
        return found

    def _fastest_ms(self, cascade: Cascade, samples: int) -> float:
        """The least latency any fleet of the app's profiled types could predict for
        ``cascade`` (:meth:`loads`' batch per stage it reaches, on the stage's fastest type, no
        queue): the service part of :func:`predicted_latency_ms` is never under it."""
        _, reach = self.reach(cascade)
        total = 0.0
        for model, share in zip(cascade.models, reach, strict=True):
            if share <= 0:
                continue
            n = max(math.ceil(share * samples), 1)
            profiles = self.config.profiles.get(model, {}).values()
            total += min((LatencyTable(p).ms(n) for p in profiles), default=math.inf)
        return total

    def _refuse_unreachable(
        self, requirements: Requirements, gear: ServingGear, samples: int
    ) -> None:
        """With no worker up, requirements no variant meets on any fleet are refused as unmet
        (a 422, as with workers up): an accuracy floor above every variant's accuracy, a
        latency bound under every variant's fastest service (:meth:`_fastest_ms`), or no variant
        with both. No fleet meets them, and a 503 says to try again. Without validation records
        the accuracy is unknown and only the latency is judged."""
        floor = requirements.min_accuracy if self.config.validation is not None else None
        needs = Requirements(self.config.name, requirements.latency_ms, floor)
        if needs.latency_ms is None and needs.min_accuracy is None:
            return
        options = [
            VariantOption(
                name=c.label,
                predicted_latency_ms=self._fastest_ms(c, samples),
                accuracy=self.reach(c)[0],
                cost_usd_per_query=0.0,
                kind="gear" if len(c.models) > 1 else "model",
            )
            for c in self.cascades(gear)
        ]
        if not options:
            return
        choice = choose(needs, options)
        if choice.met:
            return
        offer = offer_text(
            choice.option, needs, choice.latency_over_ms, choice.accuracy_short, fastest=True
        )
        raise RequirementsUnmetError(
            self.config.name,
            f"{self.config.name}: no variant meets {requirements.describe()} whatever the"
            f" fleet; closest offer: {offer}",
            choice.option.name,
        )

    def _served(self, cascade: Cascade) -> bool:
        """Whether every model of ``cascade`` has a healthy worker (what a query needs to be let
        in: ``AppDispatcher._check_serving``)."""
        return all(self.stages[m].served for m in cascade.models)

    def state(self, cascade: Cascade, loads: Sequence[StageLoad], now_s: float) -> VariantState:
        """The INFaaS state of ``cascade`` at ``loads`` (see the module docstring)."""
        for model, load in zip(cascade.models, loads, strict=True):
            if load.reach_share <= 0:
                continue
            healthy = [s for s in self.stages[model].slots if s.worker.healthy]
            if healthy and all(
                self.tracker.interfered(model, s.worker.instance_id, now_s) for s in healthy
            ):
                return "interfered"
        for load in loads:
            if load.reach_share > 0 and is_overloaded(
                load.backlog_samples, load.capacity_sps, self.config.slo_ms
            ):
                return "overloaded"
        return "active"

    def choose(
        self, requirements: Requirements, samples: int, gear: ServingGear, now_s: float
    ) -> Cascade:
        """The cascade of the cheapest variant that meets ``requirements``; raises
        :class:`~controlplane.errors.RequirementsUnmetError` with the closest offer, or
        :class:`~controlplane.errors.NoServingInstanceError` when nothing is offered."""
        options = self.options(gear, samples, now_s)
        app = self.config.name
        if not options:
            self._refuse_unreachable(requirements, gear, samples)
            raise NoServingInstanceError(app, self.config.cascade.models[0])
        # A variant with a model no healthy worker serves is offered (its latency infinite) but
        # would be refused 503 on its way in: one that is served and meets the requirements
        # comes first. Without one, the choice is among them all, as before: a variant that
        # meets them once its worker is back is a 503 (try again), none at all a 422.
        served = [(option, c) for option, c in options if self._served(c)]
        if served and len(served) < len(options):
            choice = choose(requirements, [option for option, _ in served])
            if choice.met:
                return next(c for option, c in served if option is choice.option)
        choice = choose(requirements, [option for option, _ in options])
        if choice.met:
            return next(c for option, c in options if option is choice.option)
        queued = self._queued_choice(requirements, served, samples, gear, now_s)
        if queued is not None:
            return queued
        raise RequirementsUnmetError(app, choice.message, choice.option.name)

    def _queued_choice(
        self,
        requirements: Requirements,
        served: Sequence[tuple[VariantOption, Cascade]],
        samples: int,
        gear: ServingGear,
        now_s: float,
    ) -> Cascade | None:
        """The cheapest served variant that is *overloaded* or *interfered* only and otherwise
        meets ``requirements`` (its predicted latency, its wait included, within the bound and
        finite; its accuracy at least the floor), when no active one does: a backlog is a
        passing verdict on a queue, not on what the variant can give, so the query goes to
        that queue, where admission control judges it against the SLO (a 429 with a
        ``Retry-After`` where the queue cannot serve it in time, which the overload verdict
        counts) instead of a 422 ``requirements_unmet`` that says not to try again. So is
        interference, a verdict on the instances of the moment (the dispatcher serves the
        model on them while it has no other): an interfered variant is judged at its latency
        as slowed (:meth:`_slowed_ms`), so a bound only its profiles meet is still unmet.
        ``None``: no such variant."""
        queued = [
            (option, c)
            for option, c in served
            if option.state in ("overloaded", "interfered")
            and math.isfinite(option.predicted_latency_ms)
        ]
        if not queued:
            return None
        as_active = [
            (
                replace(
                    option,
                    state="active",
                    predicted_latency_ms=self._slowed_ms(c, samples, gear, now_s),
                )
                if option.state == "interfered"
                else replace(option, state="active"),
                c,
            )
            for option, c in queued
        ]
        choice = choose(requirements, [option for option, _ in as_active])
        if not choice.met:
            return None
        return next(c for option, c in as_active if option is choice.option)

    def _slowed_ms(self, cascade: Cascade, samples: int, gear: ServingGear, now_s: float) -> float:
        """The latency :func:`~controlplane.serving.admission.predicted_latency_ms` predicts for
        ``cascade``, each stage's part (its wait and its service) times how much slower than
        its profile the stage serves now (:meth:`_slowdown`)."""
        loads = self.loads(cascade, samples, gear, now_s)
        return sum(
            predicted_latency_ms([load]) * self._slowdown(model, now_s)  # 0 where not reached
            for model, load in zip(cascade.models, loads, strict=True)
        )

    def _slowdown(self, model: str, now_s: float) -> float:
        """How much slower than its profile ``model``'s stage serves now: the least median
        measured / profiled ratio of its healthy workers, 1 where one of them is not interfered
        (the dispatcher serves on that one) or none is healthy; at least 1."""
        tracker = self.tracker
        least = math.inf
        for slot in self.stages[model].slots:
            if not slot.worker.healthy:
                continue
            instance = slot.worker.instance_id
            if not tracker.interfered(model, instance, now_s):
                return 1.0
            least = min(least, statistics.median(tracker.ratios(model, instance, now_s)))
        return max(least, 1.0) if math.isfinite(least) else 1.0
