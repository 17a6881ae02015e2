"""The demo cascade app of the gear benchmarks: the real model family when it is here, else a
seeded synthetic one.

Used by ``benchmarks/gear_switching.py`` and ``benchmarks/gear_planner_speed.py``.

- **real**: the demo family of ``provisioners.worker.family`` (scikit-learn digits; ``tiny``,
  ``small``, ``medium``, ``large``), its ``validation.json`` (trained and cached on first use, or
  the file given), and latency profiles measured on this machine by ``controlplane.apps.profiler``
  (or the reference type's profiles in the JSON given, or in the file ``heteroplane profile
  measure`` writes by default when it exists), emulated on a slow type :data:`REAL_TYPE`
  (``controlplane.apps.profiler.emulated_profiles``: every sample over the type's speed factor). Why
  slow: the family's models take well under a millisecond here, so the fleet of the benchmark
  would serve tens of thousands of queries per second and a minute of 4x load would be millions
  of simulated queries. The speed factor is chosen so that the most accurate model takes
  :data:`REAL_TOP_MS` at batch size 1; the shape of every profile (how latency grows with the
  batch, the ratios between the models) is the measured one.
- **synthetic**: :func:`estimator.cascades.synthetic_validation` records of three models
  (accuracies 93%, 96.5%, 98.5%) and linear latency profiles on ``c5.xlarge``
  (L(b) = base + per-item x b with 5% log-normal jitter), all from one seed.

The SLO is a multiple of the most accurate model's batch-1 latency (:data:`SLO_MULTIPLE`), so
that the same construction fits both families, whose latencies differ by two orders of magnitude.
The placement gives every model but the most accurate one instance and the most accurate
:data:`LARGE_INSTANCES`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controlplane.policies.gears import CascadePlacement
from estimator.cascades import ValidationRecords, load_validation, synthetic_validation
from estimator.catalog import InstanceType, default_catalog
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile, load_profiles

SYNTHETIC_MODELS = ("tiny", "small", "large")
SYNTHETIC_ACCURACY = (0.93, 0.965, 0.985)
# (base ms, ms per item) of the synthetic models on c5.xlarge.
SYNTHETIC_LATENCY_MS = {"tiny": (2.0, 0.5), "small": (4.0, 2.0), "large": (10.0, 8.0)}
SYNTHETIC_TYPE = "c5.xlarge"
SYNTHETIC_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# A slow emulated type (see the module docstring); priced as the catalog's emu.cpu.small.
REAL_TYPE = "emu.cpu.slow"
REAL_TOP_MS = 20.0
REAL_PRICE_TYPE = "emu.cpu.small"
REAL_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
REAL_SAMPLES = 20
# The latency SLO is this multiple of the most accurate model's mean latency at batch 1: room for
# a few batched stages and some queueing, whatever the family's speed.
SLO_MULTIPLE = 10.0
LARGE_INSTANCES = 3


@dataclass(frozen=True, slots=True)
class DemoFamily:
    """The demo app's family: records, profiles by model on one instance type, and the SLO."""

    source: str
    records: ValidationRecords
    profiles: dict[str, dict[str, LatencyProfile]]
    instance_type: str
    price_usd_per_hr: float
    slo_ms: float

    @property
    def models(self) -> tuple[str, ...]:
        return self.records.models

    @property
    def most_accurate(self) -> str:
        return max(self.models, key=lambda m: (self.records.model_accuracy(m), m))

    def placement(self) -> CascadePlacement:
        """One instance per model but the most accurate, which gets :data:`LARGE_INSTANCES`."""
        top = self.most_accurate
        return CascadePlacement(
            {
                m: Fleet.of({self.instance_type: LARGE_INSTANCES if m == top else 1})
                for m in self.models
            },
            self.models,
        )


def real_family_available() -> bool:
    """Whether the real family can run here (its module and torch import)."""
    return (
        importlib.util.find_spec("torch") is not None
        and importlib.util.find_spec("provisioners.worker.family") is not None
    )


def load_demo_family(
    kind: str = "auto",
    *,
    validation: Path | None = None,
    profiles: Path | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> DemoFamily:
    """The demo family: ``real``, ``synthetic``, or ``auto`` (real when it can run here, or when
    ``validation`` is given; synthetic otherwise)."""
    say = progress or (lambda _message: None)
    if kind == "auto":
        kind = "real" if validation is not None or real_family_available() else "synthetic"
    if kind == "synthetic":
        return _synthetic(seed)
    if kind != "real":
        raise ValueError(f"unknown family {kind!r} (auto, real or synthetic)")
    return _real(validation, profiles, say)


def _with_slo(
    source: str,
    records: ValidationRecords,
    profiles: dict[str, dict[str, LatencyProfile]],
    instance_type: str,
    price: float,
) -> DemoFamily:
    top = max(records.models, key=lambda m: (records.model_accuracy(m), m))
    slo_ms = SLO_MULTIPLE * profiles[top][instance_type].mean_latency_ms(1)
    return DemoFamily(source, records, profiles, instance_type, price, float(f"{slo_ms:.3g}"))


def _synthetic(seed: int) -> DemoFamily:
    rng = np.random.default_rng(seed)
    records = synthetic_validation(
        rng, SYNTHETIC_ACCURACY, names=SYNTHETIC_MODELS, n_samples=2000, dataset="synthetic"
    )
    sizes = np.array(SYNTHETIC_BATCH_SIZES)
    profiles = {
        m: {
            SYNTHETIC_TYPE: LatencyProfile(
                m,
                SYNTHETIC_TYPE,
                sizes,
                tuple((base + per * b) * rng.lognormal(0.0, 0.05, size=20) for b in sizes),
            )
        }
        for m, (base, per) in SYNTHETIC_LATENCY_MS.items()
    }
    price = default_catalog().price_usd_per_hr(SYNTHETIC_TYPE)
    return _with_slo(f"synthetic (seed {seed})", records, profiles, SYNTHETIC_TYPE, price)


def _real(
    validation: Path | None, profile_path: Path | None, say: Callable[[str], None]
) -> DemoFamily:
    catalog = default_catalog()
    where_records = str(validation)
    if validation is None:
        from provisioners.worker import family

        directory = family.ensure_family(progress=say)
        validation = directory / family.VALIDATION_FILE
        where_records = "the family cache's validation.json"
    records = load_validation(validation)
    from controlplane.apps import profiler

    if profile_path is None and real_family_available():
        from provisioners.worker import family

        # Where ``heteroplane profile measure`` writes by default.
        made = family.default_data_dir() / "profiles" / "family.json"
        profile_path = made if made.is_file() else None
    if profile_path is not None:
        measured = load_profiles(profile_path)
        types = measured.instance_types(records.models[0])
        source_type = profiler.REFERENCE_TYPE if profiler.REFERENCE_TYPE in types else types[0]
        reference = [measured.get_profile(m, source_type) for m in records.models]
        where = f"{profile_path} ({source_type})"
    else:
        say(f"measuring the family's latency here ({REAL_SAMPLES} runs per batch size)")
        reference = profiler.measure_family(
            list(records.models),
            REAL_BATCH_SIZES,
            profiler.MeasureSettings(samples=REAL_SAMPLES),
            progress=say,
        )
        where = f"measured here ({profiler.REFERENCE_TYPE})"
    top = max(records.models, key=lambda m: (records.model_accuracy(m), m))
    top_ms = next(p for p in reference if p.model == top).mean_latency_ms(1)
    price = catalog.price_usd_per_hr(REAL_PRICE_TYPE)
    slow = InstanceType(REAL_TYPE, price, speed_factor=top_ms / REAL_TOP_MS)
    emulated = {p.model: p for p in profiler.emulated_profiles(reference, [slow])}
    profiles = {m: {REAL_TYPE: emulated[m]} for m in records.models}
    return _with_slo(
        f"real ({records.dataset}, {where_records}; latency {where}, emulated on {REAL_TYPE} with"
        f" speed factor {slow.speed_factor:.3g})",
        records,
        profiles,
        REAL_TYPE,
        price,
    )
