"""One sizing model: which mix of instance types, and how many of each, serves a stage at a load.

The planner (:func:`controlplane.policies.planner.plan_app`) answers "which fleet, under the
budget and the caps, meets the P99 SLO for this trace" by simulation; it is the one authority on
a mix. Everything that sizes a fleet asks it, through this module:

* the planner itself, at the planned rate;
* :func:`controlplane.policies.capacity_curve.build_ladder`: the planner's fleet for the
  planning trace compressed in time by f (the same arrival process at f times its rate) at
  loads f from 0.2x to 5x of the plan
  (:data:`DEFAULT_LADDER_LOADS`), each a *rung*. The rungs are InferLine's plan re-made for each
  load range, the way a cascade's gear plan has a gear per load range: a rising load may be
  served better by another type than the one the plan started with, a falling one by fewer GPUs
  rather than fewer CPUs;
* the tuner (:mod:`controlplane.policies.tuner`), in ``heteroplane replay`` and in the live
  service alike (:func:`tuner_stage`), which reads the ladder as its target: at the live load the
  cheapest fleet that reaches the capacity the planner provisions there
  (:func:`controlplane.policies.tuner.ladder_fleet`), and moves the fleet towards it, adding
  before it removes.

Each rung's capacity is measured in the stage's one unit (:class:`SizingLadder` ``capacity_qps``:
the Kairos throughput bound of a Kairos-dispatched mix on the planning trace's batch mix, else the
sum of the per-instance rates mu_t on it), and so is the capacity curve m(f) = cap(rung f) /
cap(rung 1) the load model reads (:mod:`controlplane.policies.capacity_curve`). The per-instance
rates come from the planning trace's batch mix, for the replay and the live tuner alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from controlplane.policies.tuner import TunerConfig, TunerStage, utilisation_target
from estimator.envelope import arrival_envelope

__all__ = ["DEFAULT_LADDER_LOADS", "SizingLadder", "tuner_stage"]

# The loads a ladder is planned at, as multiples of the planned rate: 0.2x to 5x, about 1.4x
# apart (finer near the plan), so that between two rungs the tuner trims or fills at most a
# rung's step. Each rung is one plan: seconds for one model on the 2-core machine.
DEFAULT_LADDER_LOADS: tuple[float, ...] = (
    0.2,
    0.3,
    0.45,
    0.65,
    0.8,
    1.0,
    1.25,
    1.6,
    2.0,
    2.8,
    4.0,
    5.0,
)


@dataclass(frozen=True, slots=True)
class SizingLadder:
    """The planner's fleets for one stage across loads, and the stage's unit of capacity.

    ``rungs`` are (load f, counts by type) sorted by f; ``rate_per_instance_qps`` is mu_t for
    every type any rung uses (on the planning trace's batch mix); ``capacity_model`` the Kairos
    bound over those types where the stage is Kairos-dispatched (else None: the sum of mu_t);
    ``curve`` the capacity multipliers m(f), non-decreasing (a running maximum).
    """

    stage: str
    rungs: tuple[tuple[float, Mapping[str, int]], ...]
    rate_per_instance_qps: Mapping[str, float]
    curve: tuple[tuple[float, float], ...]
    capacity_model: Callable[[Mapping[str, int]], float] | None = field(default=None, compare=False)
    # The ladders of the same stage for other burstiness (docs/tuner.md, "Burstiness"): (CV^2
    # of the stand-in planning trace, its arrival times, its ladder on these rates and model);
    # ``cv2`` is the planning trace's own. Empty: the planning trace's burstiness only.
    cv2: float | None = None
    families: tuple[tuple[float, NDArray[np.float64], SizingLadder], ...] = field(
        default=(), compare=False
    )
    # The most queries per batch the planner gave the stage at each rung's load, (f, batch)
    # sorted by f (empty: not recorded): the planner may batch more to serve a load on fewer
    # instances, and the tuner's stage serves with the batch of its rung
    # (:meth:`controlplane.policies.tuner.TunerStage.batch_at`).
    batches: tuple[tuple[float, int], ...] = field(default=(), compare=False)

    def capacity_qps(self, fleet: Mapping[str, int]) -> float:
        """A fleet's capacity in the stage's unit (the module docstring)."""
        if self.capacity_model is not None:
            return float(self.capacity_model(fleet))
        mu = self.rate_per_instance_qps
        return float(sum(n * mu[t] for t, n in fleet.items() if n))

    def fleet_at(self, load: float) -> Mapping[str, int]:
        """The rung planned at ``load`` exactly (KeyError when there is none)."""
        for f, fleet in self.rungs:
            if f == load:
                return fleet
        raise KeyError(load)


def tuner_stage(
    ladder: SizingLadder,
    fleet: Mapping[str, int],
    config: TunerConfig,
    *,
    scale_factor: float = 1.0,
    min_instances: int = 1,
) -> TunerStage:
    """The tuner's view of a stage sized by ``ladder`` whose applied plan runs ``fleet``: mu_t and
    the capacity model over every type of the ladder (``fleet``'s must be among them), the
    capacity curve, the rungs, the planned fleet (the ladder's rung at 1x, the one the curve is
    relative to) and rho_m on the planning envelope of ``config``. The tuner's state keeps the
    fleet it runs. The replay and
    the live tuner both build their stage here, so both size the same way."""
    mu = dict(ladder.rate_per_instance_qps)
    missing = [t for t, n in fleet.items() if n and t not in mu]
    if missing:
        raise KeyError(f"the ladder of {ladder.stage} has no rate for {', '.join(missing)}")
    # The curve's multipliers are relative to the rung at 1x: its fleet is the planned one.
    try:
        counts = {t: n for t, n in ladder.fleet_at(1.0).items() if n}
    except KeyError:
        counts = {t: n for t, n in fleet.items() if n}
    rho = utilisation_target(
        counts, mu, scale_factor, config.planned_peak_rate_qps, ladder.capacity_model
    )
    burstiness = []
    for cv2, arrival_s, other in ladder.families:
        envelope = tuple(float(r) for r in arrival_envelope(arrival_s, config.windows_s).rate_qps)
        own = dataclasses.replace(config, planned_rate_qps=envelope)
        sized = tuner_stage(
            other, other.fleet_at(1.0), own, scale_factor=scale_factor, min_instances=min_instances
        )
        burstiness.append((cv2, envelope, sized))
    return TunerStage(
        ladder.stage,
        scale_factor,
        counts,
        mu,
        rho,
        min_instances=min_instances,
        capacity_model=ladder.capacity_model,
        capacity_curve=ladder.curve,
        ladder=tuple((f, dict(rung)) for f, rung in ladder.rungs),
        rung_batches=ladder.batches,
        cv2=ladder.cv2 if burstiness else None,
        burstiness=tuple(burstiness),
    )
