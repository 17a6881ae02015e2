"""Fidelity of the planner's latency model against the live service (InferLine, SoCC'20, Fig. 9).

    .venv/bin/python -m benchmarks.fidelity serving [--service-ms 5,15,50]
        [--user-model json,binary] [--cnn small|wide] [--duration-s S] [--levels 0.3,0.6,0.9]
        [--runs 3]
        [--engine httpx|raw] [--save FILE] [--from FILE ...] [--out FILE] [--json]

InferLine's Figure 9 compares the P99 its estimator predicts with the P99 the live system
measures on the same workload. Here, on the local fleet, for each *setting* (a service of its
own, on a temporary data directory):

- **an emulated model** per ``--service-ms`` (5, 15 and 50 ms per batch by default): one worker
  agent of ``emu.cpu.large`` whose model ``large`` computes a batch of one in the service time;
  its profile measured through the serving path, as ``heteroplane profile measure`` measures it
  (:func:`controlplane.apps.profiler.measure_serving_path`: batches of one sent over kept-alive
  HTTP, each sample the round trip as the dispatcher sees it);
- **a user's ONNX model** per ``--user-model`` encoding (``json``, ``binary``): a CNN,
  FP32 [N, 3, 32, 32] -> [N, 10] (``--cnn small``, the default: two convolutions of 16 and 32
  channels, a pooling, a linear layer, a few tenths of a millisecond a query on one core, so the
  serving process is the path's bottleneck; ``--cnn wide``: three convolutions of 128, 256 and
  256 channels, a few milliseconds, the service times the issue's user CNN had, so the worker
  is; seeded weights), built with the ``onnx`` package, pushed as a user would (``heteroplane
  model push``), its profile measured by the service (``heteroplane profile run``: a worker
  launched for it, timed OIP v2 batches of one), served by a real worker (onnxruntime), queries
  over
  ``POST /v2/models/{app}/infer`` as JSON or as binary tensors (``heteroplane loadgen
  --protocol v2 [--binary]``'s bodies).

Each setting: ``heteroplane serve`` (local provisioner), the app (one ``emu.cpu.large`` at most,
a 2 s SLO so that admission refuses nothing), a plan previewed for the highest level and
applied, its worker launched by the reconciler. Every loop runs at its default period but the
reconciler (every second, to launch the worker sooner). Then:

1. **Warm-up** at the lowest level of the instance's capacity, at most :data:`WARMUP_MAX_QPS`
   (``--warmup-s``, 75 s by default: longer than the calibration's minute of readings a fine
   correction is judged on; its own seed), until the service has stored its **own time per
   query** (the calibration loop's ``serving_overhead``: the median and the quantiles of the
   API's receipt to the dispatch queue, read from the store), what the planner draws for each
   simulated query, and the serving process's **CPU per query**, the service time of the queue
   the planner puts in front of the worker (:func:`controlplane.policies.planner.front_waits_ms`).
2. **The path the service does not see**, measured on the warm-up's second half: each answered
   query's client latency less the service's own time for it (``loadgen``'s ``outside_ms``:
   the client's HTTP stack, the connection, the server's parsing before the API and its writing
   after), less the load generator's own lateness in sending it (its ``send_lag_ms``: a
   generator that fell behind is the harness's fault, not the path's; the warm-up says so when
   its p99 passes :data:`SEND_LAG_NOTE_MS`; :func:`client_path_ms`). Its quantiles are the
   model's second addition. It is measured once, at the lowest rate, on a trace of its own, and
   used unchanged at every level and run: nothing is fitted to the runs it is compared with.
3. For each level rho (a share of the path's capacity: the instance's, 1000 / the profile's
   mean round trip times the calibration's factor stored in the warm-up, or the serving
   process's, 1000 / its CPU per query, whichever is less;
   a millisecond model's is the serving process's): with
   ``--level-warmup-s S`` (default 0: none), the level's own warm-up (S seconds at its rate, a
   trace of its own, not measured), after which the calibration's factor the service stored is
   read for the level's predictions; then for each run
   (``--runs``, seeds 1, 2, ...), a Poisson trace of ``--duration-s`` sent open loop by
   ``controlplane.clients.loadgen`` (the code of ``heteroplane loadgen``); P99 at the client.

The predictions, on the same trace: ``estimator.simulator`` with the profile (calibrated as
the service stored it by the warm-up's end, or by the level's warm-up with ``--level-warmup-s``:
times its factor and, where the calibration stored one, with the live round trips' spread, as
the resolver hands it to the planner at that moment; a profile measured in a moment of
contention is corrected by what the service then observed), the plan's fleet,
batch size and dispatch (FCFS), then (a) **the planner's**: plus, per query, its wait at the
serving process (:func:`controlplane.policies.planner.front_waits_ms`: a first-come first-served
queue serving each query in the stored CPU per query) and a draw from the service's stored
distribution of its own time (:func:`controlplane.policies.planner.overhead_draws_ms`), what
the planner adds to a plan's ``predicted_p99_ms``; (b) **with the client's path**: (a) plus a
draw from the distribution of step 2. Goal: measured / predicted P99 within 15%. Prints each
level's medians over the runs with their spread; writes docs/serving-fidelity.md (keeping the
demo's and the cycle's sections); ``--save`` writes the settings as JSON, ``--from``
(repeatable) reads saved ones instead of measuring, so that the page can be written from
settings measured one at a time. Exit status 1 when the planner's prediction misses the 15% at a
level's median.

:func:`run` is what ``python -m benchmarks.results`` (its "fidelity" section) calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import local_service
from controlplane.apps import profiler
from controlplane.apps.resolver import scaled_profile
from controlplane.clients import loadgen
from controlplane.clients.tensors import fit_inputs, input_specs
from controlplane.db.store import Store
from controlplane.policies.calibration import OVERHEAD_QUANTILES, draw_overhead_ms, spread_samples
from controlplane.policies.planner import front_waits_ms, overhead_draws_ms
from controlplane.provisioning import LOCAL_PROFILE_FILE
from controlplane.serving.observations import CPU_MIN_QUERIES
from estimator.catalog import default_catalog
from estimator.policies import policy_factory
from estimator.profiles import (
    LatencyProfile,
    load_profiles,
    profiles_from_document,
    write_profiles_json,
)
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals
from provisioners.worker.emulation import ComputeCurve

ROOT = Path(__file__).resolve().parents[2]
APP = "bench"
MODEL = "large"
USER_MODEL = "cnn"
USER_INPUT = "image"
USER_SHAPE = (3, 32, 32)
USER_ROWS = 256
ENCODINGS = ("json", "binary")
# The user's CNN by size: its convolutions' output channels (the last one strided by 2).
USER_CNNS: dict[str, tuple[int, ...]] = {"small": (16, 32), "wide": (128, 256, 256)}
INSTANCE_TYPE = "emu.cpu.large"
PRICE_USD_PER_HR = 0.10
INSTANCES = 1
BUDGET_USD_PER_HR = 0.15  # buys one instance of emu.cpu.large (0.10 USD/hr), not two
SLO_MS = 2000.0
TOLERANCE = 0.15
# Longer than the calibration's fine persistence (calibration_fine_persist_s, 60 s: a fine
# correction is stored at the mean of that long's readings), so that the prediction takes what
# the service has stored in steady operation, not what it stores in its first seconds.
WARMUP_S = 75.0
# The warm-up's rate at most: the serving process's CPU per query is measured in it before the
# levels are known, and a millisecond model's 30% of the instance can be past what it carries.
WARMUP_MAX_QPS = 400.0
# How long after the overhead figure the serving process's CPU per query is waited for.
CPU_WAIT_S = 15.0
# Before each level: its rate for this long (a trace of its own), so that the prediction takes
# the calibration's factor as the service has it while serving at that load; 0 (the default):
# the first warm-up's factor at every level. The factor read from the calibration's window of
# 256 batches moves between reads at one load as much as between loads (0.46 and 0.71 for the
# user's ONNX model, two reads at one rate), so the default keeps the one factor.
LEVEL_WARMUP_S = 0.0
# How long the calibration (in the tuner's tick) is given after a level's warm-up to judge it.
CALIBRATION_GRACE_S = 3.0
DEFAULT_SERVICE_MS = "5,15,50"
DEFAULT_DURATION_S = 30.0
DEFAULT_RUNS = 3
# The serving-path profile: as `heteroplane profile measure` times a cell, with more samples.
PROFILE_SAMPLES = 200
PROFILE_WARMUP = 20
# Reconcile fast; the tuner (and the calibration loop in its tick) at its default period.
SERVICE_SETTINGS = {"HETEROPLANE_RECONCILE_S": "1"}
DEFAULT_OUT = ROOT / "docs" / "serving-fidelity.md"
# The stream of the client-path draws (the planner's overhead has a stream of its own).
_OUTSIDE_STREAM = 104729

Say = Callable[[str], None]


# --- the profiles ---------------------------------------------------------------------------------


def measured_profile(
    data_dir: Path, models_dir: Path, service_ms: float, say: Say, samples: int = PROFILE_SAMPLES
) -> tuple[Path, LatencyProfile]:
    """Measure ``large`` on ``emu.cpu.large`` computing in ``service_ms`` through the serving
    path, and write the profile file the app and its workers use; (its path, the profile)."""
    catalog = default_catalog()
    compute = {MODEL: ComputeCurve(service_ms, 0.0)}
    settings = profiler.MeasureSettings(samples=samples, warmup=PROFILE_WARMUP)
    say(
        f"profiling {MODEL} on {INSTANCE_TYPE} through the serving path ({service_ms:g} ms compute)"
    )
    profiles = profiler.measure_serving_path(
        [MODEL],
        [1],
        [catalog[INSTANCE_TYPE]],
        settings,
        cache_dir=models_dir,
        compute=compute,
        progress=say,
    )
    path = data_dir / LOCAL_PROFILE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = profiler.profile_meta(settings, [catalog[INSTANCE_TYPE]], compute, "serving_path")
    write_profiles_json(profiles, path, **meta)
    return path, load_profiles(path).get_profile(MODEL, INSTANCE_TYPE)


def user_onnx(path: Path, cnn: str = "small") -> Path:
    """The user's model: FP32 [N, 3, 32, 32] -> a Conv (3x3) and a Relu per channel count of
    ``USER_CNNS[cnn]`` (the last with stride 2; small: 16, 32) -> GlobalAveragePool -> Flatten
    -> Gemm -> scores FP32 [N, 10]; seeded weights, built with the ``onnx`` package (no exporter
    needed)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    channels = USER_CNNS[cnn]

    def weights(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.normal(size=shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name
        )

    nodes, initializers, previous, width = [], [], USER_INPUT, USER_SHAPE[0]
    for index, out in enumerate(channels, 1):
        strides = [2, 2] if index == len(channels) else [1, 1]
        nodes += [
            helper.make_node("Conv", [previous, f"w{index}", f"b{index}"], [f"c{index}"],
                             kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=strides),
            helper.make_node("Relu", [f"c{index}"], [f"r{index}"]),
        ]  # fmt: skip
        initializers += [
            weights(f"w{index}", out, width, 3, 3),
            numpy_helper.from_array(np.zeros(out, np.float32), f"b{index}"),
        ]
        previous, width = f"r{index}", out
    nodes += [
        helper.make_node("GlobalAveragePool", [previous], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "wout", "bout"], ["scores"], transB=1),
    ]
    initializers += [
        weights("wout", 10, width),
        numpy_helper.from_array(np.zeros(10, np.float32), "bout"),
    ]
    graph = helper.make_graph(
        nodes,
        "user-cnn",
        [helper.make_tensor_value_info(USER_INPUT, TensorProto.FLOAT, ["N", *USER_SHAPE])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 10])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def cli(base: str, token: str, *args: str) -> Any:
    """``heteroplane ARGS --json`` against the service at ``base``, as a user runs it; its JSON."""
    env = local_service.clean_env(HETEROPLANE_URL=base, HETEROPLANE_TOKEN=token)
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", *args, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"heteroplane {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout) if done.stdout.strip() else None


def compute_only(profile: LatencyProfile, service_ms: float) -> LatencyProfile:
    """``profile`` with every sample the worker's compute time (the model before the serving
    path was profiled; kept for :mod:`benchmarks.results.fidelity`'s comparison)."""
    cells = tuple(np.full(len(cell), service_ms) for cell in profile.samples_ms)
    return LatencyProfile(profile.model, profile.instance_type, profile.batch_sizes, cells)


# --- the service ---------------------------------------------------------------------------------


def app_spec(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": APP,
        "models": [model],
        "slo": {"latency_ms": SLO_MS, "percentile": 99},
        # One instance's price: the tuner may not add a second.
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "instance_types": [INSTANCE_TYPE],
        "max_counts": {INSTANCE_TYPE: INSTANCES},
    }


def apply_plan(api: httpx.Client, top_rate_qps: float) -> dict[str, Any]:
    """Preview a plan for the top rate and apply it; the plan."""
    preview = api.post(f"/v1/apps/{APP}/plans", json={"trace": {"rate_qps": top_rate_qps}})
    preview.raise_for_status()
    plan: dict[str, Any] = preview.json()
    api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
    return plan


@contextmanager
def opened_store(data_dir: Path) -> Iterator[Store]:
    store = Store.from_url(f"sqlite:///{data_dir / 'heteroplane.db'}")
    try:
        yield store
    finally:
        store.close()


def stored_overhead(data_dir: Path) -> tuple[float, tuple[float, ...], float | None] | None:
    """The service's stored own time per query of the app (median, quantiles) and the serving
    process's CPU per query (None: not stored yet), None before it stored the first two."""
    with opened_store(data_dir) as store:
        found = store.get_serving_overhead(APP)
    if found is None or len(found.quantiles_ms) != len(OVERHEAD_QUANTILES):
        return None
    return found.overhead_ms, tuple(found.quantiles_ms), found.cpu_ms


def stored_cpu_ms(data_dir: Path, say: Say, answered: int) -> float:
    """The serving process's stored CPU per query, waited for up to :data:`CPU_WAIT_S` (the
    meter needs :data:`CPU_MIN_QUERIES` answers in closed windows; a short warm-up may not give
    them): 0, said so, when it is not there; not waited for when the warm-up ``answered`` fewer
    (the quick mode's)."""
    deadline = time.monotonic() + (CPU_WAIT_S if answered >= CPU_MIN_QUERIES else 0.0)
    while True:
        found = stored_overhead(data_dir)
        if found is not None and found[2] is not None:
            return found[2]
        if time.monotonic() >= deadline:
            say(
                "the serving process's CPU per query: not stored (too few answers in the"
                " warm-up); predicted without its queue"
            )
            return 0.0
        time.sleep(1.0)


def stored_calibration(data_dir: Path, model: str) -> tuple[float, tuple[float, ...]]:
    """The calibration of ``model`` on the instance type: its factor (1 when it stored none)
    and the live round trips' spread (empty when it stored none); the resolver calibrates the
    profile with both for the planner (``scaled_profile``)."""
    with opened_store(data_dir) as store:
        for record in store.list_profile_scales(APP):
            if (record.model, record.instance_type) == (model, INSTANCE_TYPE):
                return float(record.factor), record.spread
    return 1.0, ()


def spread_p99(spread: Sequence[float]) -> float | None:
    """A stored spread's p99 over its mean (None: none stored, the profile's own spread)."""
    if not spread:
        return None
    return float(np.percentile(spread_samples(spread, 1.0), 99.0))


def stored_profile(data_dir: Path, model: str) -> LatencyProfile:
    """The profile of ``model`` on the instance type the service measured and stored."""
    with opened_store(data_dir) as store:
        document = store.get_app_profiles(APP)
    if document is None:
        raise SystemExit(f"the service stored no profiles for {APP}")
    return profiles_from_document(document, "the stored profiles").get_profile(model, INSTANCE_TYPE)


# --- measuring and predicting --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a level: the measured and the predicted figures (ms)."""

    seed: int
    queries: int
    errors: int
    measured_p50_ms: float
    measured_p99_ms: float
    predicted_p50_ms: float  # the planner's
    predicted_p99_ms: float  # the planner's
    client_path_p99_ms: float  # the planner's plus the path outside the service
    send_lag_p99_ms: float
    outside_p50_ms: float | None  # measured in this run (not used by the prediction)
    outside_p99_ms: float | None
    load_average: float  # 1 min, at the run's end
    # The answers' queue_ms (the service's queue: admission, the stage's queue, the event
    # loop), p99 over the run; None in settings saved before it was recorded.
    queue_p99_ms: float | None = None
    # The serving process's CPU over the run (its event loop, the API, the dispatch, the
    # transport; the loops run in a process of their own) per answered query, ms.
    service_cpu_ms: float | None = None


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def spread_text(values: Sequence[float], digits: int = 1) -> str:
    """``median (min-max)``, or the one value."""
    median, low, high = median_spread(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


@dataclass(frozen=True, slots=True)
class Level:
    utilisation: float
    rate_qps: float
    runs: list[Run]
    # The calibration's factor the service had stored after the level's own warm-up (what the
    # level's predictions multiply the profile by); None: the setting's, from the first warm-up.
    profile_scale: float | None = None

    def figure(self, name: str) -> list[float]:
        return [float(getattr(run, name)) for run in self.runs]

    @property
    def ratios(self) -> list[float]:
        """Measured over the planner's predicted P99, per run."""
        return [r.measured_p99_ms / r.predicted_p99_ms for r in self.runs]

    @property
    def client_ratios(self) -> list[float]:
        """Measured over the prediction with the client's path, per run."""
        return [r.measured_p99_ms / r.client_path_p99_ms for r in self.runs]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def client_ratio(self) -> float:
        return statistics.median(self.client_ratios)

    @property
    def error(self) -> float:
        """The planner's predicted P99 less the measured one, over the measured one: the median
        over the runs."""
        return statistics.median(r.predicted_p99_ms / r.measured_p99_ms - 1.0 for r in self.runs)

    @property
    def client_error(self) -> float:
        return statistics.median(r.client_path_p99_ms / r.measured_p99_ms - 1.0 for r in self.runs)

    @property
    def holds(self) -> bool:
        """The planner's predicted P99 within 15% of the measured one (the goal: the median
        over the runs)."""
        return abs(self.error) <= TOLERANCE

    @property
    def client_holds(self) -> bool:
        return abs(self.client_error) <= TOLERANCE


@dataclass(frozen=True, slots=True)
class Setting:
    """One service: what was served, its plan, its profile's mean and p99 round trip, the
    service's stored own time per query (median, p99), the client's path measured in the
    warm-up (its quantiles), the levels, the load averages."""

    label: str
    service_ms: float | None  # the emulated compute; None for the user's model
    encoding: str | None  # the user's model's: json or binary
    plan: dict[str, Any]
    round_trip_ms: float
    round_trip_p99_ms: float
    overhead_ms: float
    overhead_p99_ms: float
    outside_quantiles_ms: list[float]
    levels: list[Level]
    engine: str = "httpx"
    profile_scale: float = 1.0  # the calibration's factor on the profile at the warm-up's end
    # The stored spread's p99 over its mean at the warm-up's end (None: the profile's own).
    profile_spread_p99: float | None = None
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    # The serving process's CPU per query as the service stored it in the warm-up (0: not
    # measured, a setting written before it was).
    cpu_ms: float = 0.0
    # The user's CNN (USER_CNNS; None: the emulated model, or a setting written before there
    # were two, the small one).
    cnn: str | None = None
    # Whether the instance's capacity the levels are shares of is the calibrated profile's
    # (its mean times the factor stored in the warm-up: the worker as it runs live), or the
    # profile's as measured (a setting written before 2026-12-06).
    calibrated: bool = False

    @property
    def holds(self) -> bool:
        return all(level.holds for level in self.levels)

    @property
    def client_holds(self) -> bool:
        return all(level.client_holds for level in self.levels)

    @property
    def instance_qps(self) -> float:
        """The instance's capacity: 1000 / its mean round trip, calibrated where
        :attr:`calibrated` (the profile's as measured before)."""
        scale = self.profile_scale if self.calibrated else 1.0
        return INSTANCES * 1000.0 / (self.round_trip_ms * scale)

    @property
    def serving_qps(self) -> float:
        """The serving process's capacity: 1000 / its CPU per query (infinite: not measured)."""
        return 1000.0 / self.cpu_ms if self.cpu_ms > 0 else math.inf

    @property
    def capacity_qps(self) -> float:
        """The path's capacity, which the levels are shares of: the instance's or the serving
        process's, whichever is less."""
        return min(self.instance_qps, self.serving_qps)

    @property
    def outside_p50_ms(self) -> float:
        return self.outside_quantiles_ms[OVERHEAD_QUANTILES.index(50.0)]

    @property
    def outside_p99_ms(self) -> float:
        return self.outside_quantiles_ms[OVERHEAD_QUANTILES.index(99.0)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Setting:
        levels = [
            Level(
                lv["utilisation"],
                lv["rate_qps"],
                [Run(**run) for run in lv["runs"]],
                lv.get("profile_scale"),
            )
            for lv in document["levels"]
        ]
        return cls(**{**document, "levels": levels})


def poisson_trace(rate_qps: float, duration_s: float, seed: int) -> Trace:
    arrivals = poisson_arrivals(rate_qps, duration_s, np.random.default_rng(seed))
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def predict(trace: Trace, profile: LatencyProfile, fleet: dict[str, int], batch: int) -> np.ndarray:
    """Response times (ms) the simulator predicts for ``trace`` on ``fleet`` under FCFS."""
    used = {INSTANCE_TYPE: profile}
    instances = tuple(InstanceSpec(t) for t in sorted(fleet) for _ in range(fleet[t]))
    stage = Stage(profile.model, instances, used, policy_factory("fcfs", used, list(used))(), batch)
    result = simulate(
        trace,
        [stage],
        np.random.default_rng(0),
        prices_usd_per_hr={INSTANCE_TYPE: PRICE_USD_PER_HR},
    )
    response_ms: np.ndarray = result.response_ms
    return response_ms


@dataclass(frozen=True, slots=True)
class Model:
    """What the predictions of one setting are made of."""

    profile: LatencyProfile  # through the serving path
    overhead_ms: float  # the service's stored own time per query: the median
    overhead_quantiles_ms: tuple[float, ...]  # and its distribution
    outside_quantiles_ms: tuple[float, ...]  # the path the service does not see
    fleet: dict[str, int]
    batch: int
    cpu_ms: float = 0.0  # the serving process's stored CPU per query (its queue's service)

    def predictions(self, trace: Trace, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query: the planner's prediction, and it with the client's path added."""
        response = predict(trace, self.profile, self.fleet, self.batch)
        planner = (
            response
            + front_waits_ms(trace.arrival_s, self.cpu_ms)
            + overhead_draws_ms(response.size, seed, self.overhead_ms, self.overhead_quantiles_ms)
        )
        rng = np.random.default_rng([seed, _OUTSIDE_STREAM])
        outside = draw_overhead_ms(self.outside_quantiles_ms, response.size, rng)
        return planner, planner + outside


@dataclass(frozen=True, slots=True)
class Load:
    """How a setting's queries are made: ``build(trace)`` gives them, sent to ``url``."""

    url: str
    token: str
    build: Callable[[Trace], list[loadgen.Query]]
    engine: str
    pid: int | None = None  # the serving process's, whose CPU each run reads


def service_cpu_s(pid: int | None) -> float | None:
    """The CPU seconds (user + system) the serving process ``pid`` used so far; None without
    one or where ``/proc`` cannot say."""
    if pid is None:
        return None
    try:
        return local_service.cpu_s(pid)
    except (OSError, ValueError, IndexError):
        return None


def send(load: Load, trace: Trace, say: Say | None = None) -> loadgen.LoadResult:
    return loadgen.run_load(
        load.build(trace),
        load.url,
        load.token,
        timeout_s=30.0,
        progress=None if say is None else (lambda snapshot: say("  " + snapshot.line())),
        progress_every_s=15.0,
        engine=load.engine,
    )


def run_level(
    utilisation: float,
    rate_qps: float,
    duration_s: float,
    seed: int,
    load: Load,
    model: Model,
    say: Say,
) -> Run:
    trace = poisson_trace(rate_qps, duration_s, seed * 1000 + int(utilisation * 1000))
    say(
        f"rho {utilisation:g}, seed {seed}: {len(trace)} queries at {rate_qps:.2f} qps for"
        f" {duration_s:g} s"
    )
    cpu_before = service_cpu_s(load.pid)
    summary = send(load, trace, say).summary(SLO_MS)
    cpu_after = service_cpu_s(load.pid)
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None and summary.answered:
        cpu_ms = (cpu_after - cpu_before) * 1000.0 / summary.answered
    if summary.p99_ms is None or summary.p50_ms is None:
        raise SystemExit(f"rho {utilisation:g}: nothing was answered: {summary.errors_by_kind}")
    planner, client = model.predictions(trace, seed)
    run = Run(
        seed,
        len(trace),
        summary.errors,
        summary.p50_ms,
        summary.p99_ms,
        float(np.percentile(planner, 50)),
        float(np.percentile(planner, 99)),
        float(np.percentile(client, 99)),
        summary.send_lag_p99_ms or 0.0,
        summary.outside_p50_ms,
        summary.outside_p99_ms,
        round(os.getloadavg()[0], 2),
        summary.queue_p99_ms,
        cpu_ms,
    )
    say(
        f"  measured p99 {run.measured_p99_ms:.1f} ms; predicted {run.predicted_p99_ms:.1f} ms"
        f" (planner), {run.client_path_p99_ms:.1f} ms (with the client's path); the service's"
        f" queue p99 {'-' if run.queue_p99_ms is None else f'{run.queue_p99_ms:.1f} ms'}, its"
        f" CPU a query {'-' if cpu_ms is None else f'{cpu_ms:.2f} ms'};"
        f" errors {summary.errors} {dict(summary.errors_by_kind)}"
    )
    return run


# A warm-up whose generator sent this late at p99 says so (the runs report theirs: send_lag).
SEND_LAG_NOTE_MS = 5.0


def client_path_ms(
    outcomes: Sequence[loadgen.QueryResult], after_s: float
) -> tuple[list[float], float]:
    """The path outside the service (step 2 of the module docstring) of each answered query
    scheduled ``after_s`` or more past the first one: its latency from the moment it left the
    client (not from its scheduled send, which a generator that fell behind left late: that
    lag is the generator's, not the path's) less the service's own time for it; and the p99 of
    those queries' send lag (0 without any)."""
    start = min((o.finished_s - o.latency_ms / 1000.0 for o in outcomes), default=0.0)
    kept = [
        o
        for o in outcomes
        if o.outside_ms is not None and o.finished_s - o.latency_ms / 1000.0 - start >= after_s
    ]
    path = [o.outside_ms - o.send_lag_ms for o in kept if o.outside_ms is not None]
    lag = float(np.percentile([o.send_lag_ms for o in kept], 99)) if kept else 0.0
    return path, lag


def warm_up(
    load: Load, rate_qps: float, warmup_s: float, data_dir: Path, process: Any, say: Say
) -> tuple[float, tuple[float, ...], tuple[float, ...], float]:
    """Warm up at ``rate_qps`` (:func:`measure`, steps 1 and 2): the stored overhead (median,
    quantiles), the quantiles of the path outside the service on the warm-up's second half and
    the serving process's stored CPU per query."""
    say(f"warm-up: {warmup_s:g} s at {rate_qps:.1f} qps")
    result = send(load, poisson_trace(rate_qps, warmup_s, 99))
    outside, lag_p99 = client_path_ms(result.outcomes, warmup_s / 2.0)
    if lag_p99 > SEND_LAG_NOTE_MS:
        say(
            f"warm-up: the load generator fell behind (its send lag p99 {lag_p99:.1f} ms); the"
            " client's path leaves the lag out"
        )
    if len(outside) < 20:
        raise SystemExit(f"warm-up: {len(outside)} answers with the service's time; too few")
    found = local_service.wait_for(
        "the service's overhead figure",
        lambda: stored_overhead(data_dir),
        process,
        data_dir / "serve.log",
    )
    overhead, quantiles, _ = found
    cpu_ms = stored_cpu_ms(data_dir, say, sum(1 for o in result.outcomes if o.answered))
    outside_q = tuple(float(q) for q in np.percentile(outside, OVERHEAD_QUANTILES))
    p99 = OVERHEAD_QUANTILES.index(99.0)
    say(
        f"the service's own time per query: median {overhead:.2f} ms, p99 {quantiles[p99]:.2f}"
        f" ms; its CPU per query {cpu_ms:.3f} ms; outside it (the client's path): median"
        f" {outside_q[50]:.2f} ms, p99 {outside_q[p99]:.2f} ms ({len(outside)} queries)"
    )
    return overhead, quantiles, outside_q, cpu_ms


def level_warm_up(
    load: Load,
    utilisation: float,
    rate_qps: float,
    warmup_s: float,
    seed: int,
    data_dir: Path,
    profile: LatencyProfile,
    say: Say,
) -> tuple[float, tuple[float, ...]]:
    """Serve ``rate_qps`` for ``warmup_s`` (a trace of its own, not measured), give the
    calibration a moment to judge it, and return the factor and spread the service then stores
    for the profile: what the planner reads while the service runs at that load."""
    say(f"rho {utilisation:g}: the level's warm-up, {warmup_s:g} s at {rate_qps:.1f} qps")
    send(load, poisson_trace(rate_qps, warmup_s, seed))
    time.sleep(CALIBRATION_GRACE_S)
    scale, spread = stored_calibration(data_dir, profile.model)
    say(f"rho {utilisation:g}: the calibration's factor on the profile: {scale:.3f}")
    return scale, spread


@dataclass(frozen=True, slots=True)
class Options:
    utilisations: Sequence[float]
    duration_s: float
    runs: int = DEFAULT_RUNS
    warmup_s: float = WARMUP_S
    profile_samples: int = PROFILE_SAMPLES
    engine: str = "httpx"
    level_warmup_s: float = LEVEL_WARMUP_S


def measure(
    service_ms: float | None,
    options: Options,
    say: Say = local_service.log,
    *,
    encoding: str | None = None,
    cnn: str = "small",
) -> Setting:
    """One setting (module docstring): the emulated model computing in ``service_ms``, or with
    ``service_ms`` None the user's ONNX model ``cnn`` (:data:`USER_CNNS`) queried with
    ``encoding``."""
    from provisioners.worker import family

    label = (
        f"service time {service_ms:g} ms"
        if service_ms is not None
        else f"a user's {'' if cnn == 'small' else cnn + ' '}ONNX CNN over /v2, {encoding}"
    )
    say(f"--- {label}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="heteroplane-fidelity-"))
    try:
        models_dir = local_service.prepare_family(data_dir)
        profile_path: Path | None = None
        if service_ms is not None:
            profile_path, profile = measured_profile(
                data_dir, models_dir, service_ms, say, options.profile_samples
            )
        token = local_service.issue_token(data_dir, "fidelity-bench")
        port = local_service.free_port()
        base = f"http://127.0.0.1:{port}"
        with local_service.serving_api(
            data_dir, port, token, model=MODEL, settings=SERVICE_SETTINGS
        ) as (process, api, log_path):
            if profile_path is not None:
                api.post(
                    "/v1/apps", json=app_spec({"name": MODEL, "profiles": str(profile_path)})
                ).raise_for_status()
                inputs = family.load_split().validation_inputs
                url = loadgen.infer_url(base, APP)

                def build(trace: Trace) -> list[loadgen.Query]:
                    return loadgen.build_queries(trace, inputs)
            else:
                onnx_path = user_onnx(data_dir / "cnn.onnx", cnn)
                say(f"heteroplane model push {USER_MODEL} {onnx_path.name}")
                cli(base, token, "model", "push", USER_MODEL, str(onnx_path))
                api.post(
                    "/v1/apps", json=app_spec({"name": USER_MODEL, "artifact": USER_MODEL})
                ).raise_for_status()
                say(f"heteroplane profile run ({options.profile_samples} samples)")
                cli(base, token, "profile", "run", "--app", APP, "--types", INSTANCE_TYPE,
                    "--batch-sizes", "1", "--samples", str(options.profile_samples))  # fmt: skip
                profile = stored_profile(data_dir, USER_MODEL)
                specs = input_specs(api.get(f"/v2/models/{APP}").json())
                rows = np.random.default_rng(0).normal(size=(USER_ROWS, *USER_SHAPE))
                arrays = fit_inputs({USER_INPUT: rows.astype(np.float32)}, specs)
                url = loadgen.infer_url(base, APP, "v2")
                binary = encoding == "binary"

                def build(trace: Trace) -> list[loadgen.Query]:
                    return loadgen.build_tensor_queries(trace, arrays, specs, "v2", binary)

            round_trip = profile.mean_latency_ms(1)
            p99_trip = float(np.percentile(profile.samples_ms[0], 99))
            capacity = INSTANCES * 1000.0 / round_trip
            rates = [u * capacity for u in options.utilisations]
            say(
                f"serving path: {round_trip:.2f} ms per batch of one (p99 {p99_trip:.2f});"
                f" the instance's capacity {capacity:.1f} qps"
            )
            plan = apply_plan(api, max(rates))
            stage = plan["stages"][0]
            fleet = {str(k): int(v) for k, v in stage["fleet"].items()}
            batch = int(stage["batch_size"])
            say(f"plan: {fleet}, batch size {batch}, policy {stage['policy']}")

            def running() -> bool:
                rows = api.get("/v1/instances", params={"app": APP}).json()
                return sum(r["state"] == "running" for r in rows) >= sum(fleet.values())

            local_service.wait_for("the workers", running, process, log_path)
            probe = build(poisson_trace(1.0, 5.0, 0))[0]
            probe_headers = {"Content-Type": probe.content_type, **probe.headers()}
            local_service.wait_for(
                "an answer",
                lambda: api.post(url, content=probe.body, headers=probe_headers).status_code == 200,
                process,
                log_path,
            )
            load = Load(url, token, build, options.engine, process.pid)
            overhead, quantiles, outside, cpu_ms = warm_up(
                load, min(rates[0], WARMUP_MAX_QPS), options.warmup_s, data_dir, process, say
            )
            scale, spread = stored_calibration(data_dir, profile.model)
            tail = spread_p99(spread)
            say(
                f"the calibration's factor on the profile: {scale:.3f}; the live round trips'"
                " spread: "
                + ("none stored" if tail is None else f"stored, p99 {tail:.2f} times the mean")
            )
            # The levels are shares of the path's capacity as the service knows it once warm:
            # the instance's at the calibrated profile (a worker whose calls run 7% slower live
            # than profiled is at 96% of its capacity at "90%" of the profile's), or the serving
            # process's (a queue in front of it, 1000 / its CPU per query) where that is less.
            capacity = INSTANCES * 1000.0 / (round_trip * scale)
            front_qps = 1000.0 / cpu_ms if cpu_ms > 0 else math.inf
            if front_qps < capacity:
                say(
                    f"the serving process's capacity {front_qps:.1f} qps (its CPU per query"
                    f" {cpu_ms:.3f} ms) is below the instance's: the levels are its shares"
                )
                capacity = front_qps
            rates = [u * capacity for u in options.utilisations]
            say(f"levels {', '.join(f'{r:.1f}' for r in rates)} qps")
            levels = []
            for index, (u, r) in enumerate(zip(options.utilisations, rates, strict=True)):
                level_scale, level_spread = scale, spread
                if options.level_warmup_s > 0:
                    level_scale, level_spread = level_warm_up(
                        load, u, r, options.level_warmup_s, 500 + index, data_dir, profile, say
                    )
                model = Model(
                    scaled_profile(profile, level_scale, level_spread),
                    overhead,
                    quantiles,
                    outside,
                    fleet,
                    batch,
                    cpu_ms,
                )
                runs = [
                    run_level(u, r, options.duration_s, seed, load, model, say)
                    for seed in range(1, options.runs + 1)
                ]
                levels.append(
                    Level(u, r, runs, level_scale if options.level_warmup_s > 0 else None)
                )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return Setting(
        label,
        service_ms,
        encoding,
        plan,
        round_trip,
        p99_trip,
        overhead,
        quantiles[OVERHEAD_QUANTILES.index(99.0)],
        list(outside),
        levels,
        options.engine,
        scale,
        spread_p99(spread),
        load_before,
        [round(x, 2) for x in os.getloadavg()],
        round(time.monotonic() - started, 1),
        cpu_ms,
        None if service_ms is not None else cnn,
        calibrated=True,
    )


def round_trip_spread_text(setting: Setting) -> str:
    """What the calibration stored of the live round trips' spread (a sentence)."""
    if setting.profile_spread_p99 is None:
        return "The calibration stored no spread: the profile's own spread is planned with."
    return (
        "The calibration found the live round trips' spread off the profile's and stored it:"
        f" their p99 is {setting.profile_spread_p99:.2f} times their mean (the profile's:"
        f" {setting.round_trip_p99_ms / setting.round_trip_ms:.2f}), and the planner's profile"
        " has that spread."
    )


def run(
    service_times: Sequence[float],
    options: Options,
    say: Say = local_service.log,
    encodings: Sequence[str] = (),
    cnn: str = "small",
) -> list[Setting]:
    """Every emulated service time, then the user's model ``cnn`` in each encoding (module
    docstring)."""
    settings = [measure(s, options, say) for s in service_times]
    return settings + [measure(None, options, say, encoding=e, cnn=cnn) for e in encodings]


def as_json(settings: Sequence[Setting]) -> list[dict[str, Any]]:
    """The levels as JSON rows (one per setting and level: the medians over the runs)."""
    rows = []
    for s in settings:
        for level in s.levels:
            rows.append(
                {
                    "setting": s.label,
                    "service_ms": s.service_ms,
                    "encoding": s.encoding,
                    "cnn": s.cnn,
                    "round_trip_ms": s.round_trip_ms,
                    "overhead_ms": s.overhead_ms,
                    "overhead_p99_ms": s.overhead_p99_ms,
                    "outside_p99_ms": s.outside_p99_ms,
                    "capacity_qps": s.capacity_qps,
                    "serving_cpu_ms": s.cpu_ms,
                    "utilisation": level.utilisation,
                    "rate_qps": level.rate_qps,
                    "runs": len(level.runs),
                    "measured_p99_ms": statistics.median(level.figure("measured_p99_ms")),
                    "predicted_p99_ms": statistics.median(level.figure("predicted_p99_ms")),
                    "client_path_p99_ms": statistics.median(level.figure("client_path_p99_ms")),
                    "ratio": level.ratio,
                    "ratio_min": min(level.ratios),
                    "ratio_max": max(level.ratios),
                    "client_ratio": level.client_ratio,
                    "error": level.error,
                    "client_error": level.client_error,
                    "holds": level.holds,
                    "client_holds": level.client_holds,
                }
            )
    return rows


# --- the report ----------------------------------------------------------------------------------


HEADER = (
    "| rho | rate, qps | factor | queries | P99 measured, ms | P99 planner, ms |"
    " measured / planner | P99 planner + client's path, ms | measured / with client's path |"
    " outside the service, p50 / p99, ms | the service's queue p99 / CPU a query, ms | errors |"
    " load average |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def section(setting: Setting) -> str:
    """The table of one setting and what it says."""
    stage = setting.plan.get("stages", [{}])[0]
    rows = []
    for lv in setting.levels:
        outside = [
            f"{r.outside_p50_ms:.1f} / {r.outside_p99_ms:.1f}"
            for r in lv.runs
            if r.outside_p50_ms is not None and r.outside_p99_ms is not None
        ]
        queued = "; ".join(
            ("-" if r.queue_p99_ms is None else f"{r.queue_p99_ms:.1f}")
            + ("" if r.service_cpu_ms is None else f" / {r.service_cpu_ms:.2f}")
            for r in lv.runs
        )
        rows.append(
            f"| {lv.utilisation:g} | {lv.rate_qps:.1f} |"
            f" {setting.profile_scale if lv.profile_scale is None else lv.profile_scale:.3f} |"
            f" {sum(r.queries for r in lv.runs)} |"
            f" **{spread_text(lv.figure('measured_p99_ms'))}** |"
            f" {spread_text(lv.figure('predicted_p99_ms'))} | **{spread_text(lv.ratios, 3)}**"
            f" ({'within' if lv.holds else 'NOT within'} 15%) |"
            f" {spread_text(lv.figure('client_path_p99_ms'))} |"
            f" **{spread_text(lv.client_ratios, 3)}**"
            f" ({'within' if lv.client_holds else 'NOT within'} 15%) |"
            f" {'; '.join(outside)} | {queued} | {sum(r.errors for r in lv.runs)} |"
            f" {spread_text(lv.figure('load_average'), 2)} |"
        )
    held = sum(lv.holds for lv in setting.levels)
    client_held = sum(lv.client_holds for lv in setting.levels)
    what = (
        f"the worker computes {setting.service_ms:g} ms of it"
        if setting.service_ms is not None
        else "onnxruntime's compute on the worker, the request's binary tensors, the JSON"
        " answer and the HTTP"
    )
    bottleneck = (
        "the serving process" if setting.serving_qps < setting.instance_qps else "the instance"
    )
    serving = (
        "The serving process's CPU per query was not measured (a setting written before it"
        " was): the levels are shares of the instance's capacity."
        if setting.cpu_ms <= 0
        else f"The serving process's CPU per query, as the service measured and stored it:"
        f" {setting.cpu_ms:.3f} ms, so it carries at most {setting.serving_qps:.1f} qps; the"
        f" levels (rho) are shares of the lesser of the two, {setting.capacity_qps:.1f} qps"
        f" ({bottleneck})."
    )
    calibrated = (
        f" (at the calibrated profile: {setting.round_trip_ms:.2f} ms times the warm-up's factor"
        f" {setting.profile_scale:.3f})"
        if setting.calibrated
        else " (at the profile as measured, before the calibration's factor)"
    )
    runs = len(setting.levels[0].runs) if setting.levels else 0
    title = (
        f"{setting.label[0].upper()}{setting.label[1:]}: the planner within 15% at {held} of"
        f" {len(setting.levels)} levels, with the client's path at {client_held}"
    )
    return f"""## {title}

The plan: {json.dumps(stage.get("fleet", {}))}, batch size {stage.get("batch_size")}, policy
{stage.get("policy")}. The serving-path profile: {setting.round_trip_ms:.2f} ms per batch of one
(p99 {setting.round_trip_p99_ms:.2f} ms; {what}), so the instance's capacity is
{setting.instance_qps:.1f} qps{calibrated}. {serving} The calibration's factor on that profile
at the warm-up's end (what the planner's profile is multiplied by; 1: none stored):
{setting.profile_scale:.3f}; the table's "factor" is the one each level's predictions used.
{round_trip_spread_text(setting)} The service's own time per query, as it measured and stored it:
median {setting.overhead_ms:.2f} ms, p99 {setting.overhead_p99_ms:.2f} ms. Outside it, measured
in the warm-up: median {setting.outside_p50_ms:.2f} ms, p99 {setting.outside_p99_ms:.2f} ms.
Medians of {runs} runs (seeds 1-{runs}) with their range; the setting took {setting.wall_s:.0f}
s, load average {" / ".join(map(str, setting.load_before))} before and
{" / ".join(map(str, setting.load_after))} after.

{HEADER}
{chr(10).join(rows)}
"""


WHY = """**The model.** A query's time at the client has five parts. (1) The worker's round trip
(the request's binary tensors, the agent's parsing, the model, the JSON answer, loopback HTTP),
which keeps the worker busy and
so also queues: the profile is measured through that path (`heteroplane profile measure` for the
emulated models, `heteroplane profile run` for a registry model), and the simulator queues it; the
calibration keeps the profile's mean (a factor) and, where the live round trips' tail is off the
profile's by more than 25%, its spread (the observed shape) current, and the planner's profile has
both. (2) The control plane's own path before and around the dispatch queue (the API's parsing, the
token check, validation, the event loop; the dispatch's wait for the event loop's turn with the
instance already free), which delays every query but keeps no worker busy: the service measures it
on its own traffic and the calibration loop stores its median and its quantiles (the app's
`serving_overhead`); the planner draws each simulated query's share from them, so a service whose
own time has a long tail moves the predicted P99 by its tail, not its median. (2b) The serving
process as a queue of its own in front of the worker: every query takes some of its one event
loop's CPU (uvicorn's parsing and writing, the API, the dispatch, the transport), and a query that
arrives while it is busy waits. The service measures its CPU per answered query (idle share taken
off) and the calibration stores it; the planner adds each simulated query's wait at a
first-come first-served queue serving every query in that time (Lindley's recursion). For a
millisecond model it is the path's bottleneck: the levels below are shares of the lesser of the
instance's capacity and the serving process's (1000 / its CPU per query). (3) The path the
service does not see: the client's HTTP stack, the connection, the server reading and parsing the
request before the API is called (uvicorn's httptools protocol) and writing the answer back. Every
answer carries the service's own time for it (`total_ms`), so a client can measure this part: its
latency less that time (`heteroplane loadgen` reports it as `outside_p50_ms` / `outside_p99_ms`).
(4) CPU contention that grows with the load on a machine the load generator, the service and the
workers share.

"P99 planner" is what the planner predicts with (1), (2) and (2b): a plan's `predicted_p99_ms`.
"Planner + client's path" adds (3), drawn per query from its distribution measured once per
setting in the warm-up (at the lowest rate, on a trace of its own; nothing in it is fitted to
the runs in the table). The planner cannot know (3) for an arbitrary client: it is the client's,
and the service's only view of it would be a probe of its own; the goal is judged on both
columns. (4) is in neither: the "outside the service" column shows how the unseen part grows
with the load on this 2-core machine.

**What the figures below say** (measured 2026-12-06 between 4:17 and 4:51 pm, the seven
settings one after another on a quiet machine, load average 0.1-1.3, 75 s warm-ups, the levels
shares of the calibrated instance's capacity). The planner holds at 11 of 21 levels, with the
client's path at 12: at every level of the emulated 5, 15 and 50 ms models (0.94-1.04; at 5 ms
with a factor of 1.084 stored in the warm-up), at none of the small ONNX CNN's six levels (its
worker ran 1.4-2.3 times slower live than profiled, the stored factors; the measured P99 1.4-1.6
times the plan's at 30%, 2.0 at 60% and 16-17 at 90%, where the serving process, the worker and
the load generator together saturate the two cores; with the client's path the 30% levels hold,
1.14 and 1.02), and at one of three of the wide CNN in each encoding (JSON at 60%, 0.90; binary
at 30%, 1.11). The wide CNN's other levels go both ways: 1.37 at 30% with JSON, and at 60% and
90% the plan's P99 is over the measured one (0.86-0.90 and 0.61-0.63): the warm-up stored a
factor of 1.15-1.26 that the runs at higher rates did not need. One more run of the wide CNN in
binary with each level's own warm-up of 75 s (`--level-warmup-s 75`, the factor the service
stored at that level: 1.079, 1.093, 1.018 after the first warm-up's 1.306) held at 30% and 60%
(1.09, 0.93) and not at 90% (1.25): the factor of a model of a few milliseconds on this machine
moves by a quarter between warm-ups minutes apart, which is the whole of the 15% at 90% load.
The same code's set that morning (9:19-9:51 am, a busier machine) also held at 11 of 21, 12
with the client's path, but at 5 ms only at 30% (1.10; 1.68 and 2.08 at 60% and 90%, no
factor stored).

The set of 3:10-3:46 am the same day, on the code before (the 5% threshold): 13 of 21, 12 with
the client's path; at 5 ms 1.12, 1.16 and 1.79 at 90% with no factor stored; 15 and 50 ms at
every level (1.02-1.10); the small CNN at none; the wide CNN at 60% and 90% with JSON, at every
level with binary. Eight sets of the 5 ms setting alone that day (`--service-ms 5`, four on
each threshold, alternating) held at 7 and 9 of 12 levels with the new and the old threshold:
the thresholds differ only where the warm-up's miss lies between 1.45% and 5% (a set that
stored 1.026, which the 5% would not have, held at 3 of 3; the first new set ran at 0.015),
and the machine's speed moved between a warm-up and its runs by more than either (factors of
1.000-1.266 stored in warm-ups minutes apart): the change is the model's own arithmetic, not a
figure these runs show.

The set before (2026-11-30, levels as shares of the profile's capacity before the factor, the
machine faster): 13 of 21 as well, 13 with the client's path; it held at 5 ms at 30% and 60%
(1.13, 1.10; 1.43 at 90% with a factor of 1.071 stored), at every level at 15 and 50 ms, at one
of six levels of the small ONNX CNN (binary at 90%, 1.17, inside runs of 0.82-1.34) and at 30%
and 60% of the wide CNN in both encodings (1.00-1.10), at 90% in neither. What fails in all
three sets is the same: the 90% level of a model of a few milliseconds, where the P99 turns on a few
percent of service time no calibration of a minute's evidence pins down, and a model of tenths
of a millisecond whose path is the serving process on cores it shares with the load generator
and the worker."""


def markdown(
    settings: Sequence[Setting],
    commands: Sequence[str],
    duration_s: float,
) -> str:
    levels = [level for s in settings for level in s.levels]
    held = sum(level.holds for level in levels)
    client_held = sum(level.client_holds for level in levels)
    cpu = local_service.cpu_model()
    reproduce = "\n".join(f"    {command}" for command in commands)
    engines = sorted({s.engine for s in settings})
    return f"""# Serving fidelity: the planner's latency model against the live service

Written by `python -m benchmarks.fidelity serving`; do not edit by hand, run it again. The
settings below were measured one at a time (each under ten minutes) and written together:

{reproduce}

- Run: {time.strftime("%Y-%m-%d")}, on {cpu} ({platform.machine()}, {os.cpu_count()} CPUs),
  Python {platform.python_version()}, a machine shared with other work (the load averages are
  with each setting and run; the service, its workers and the load generator share the CPUs
  with it). The figures move with that load: they are medians of runs with their range, not
  confidence intervals.
- The live side: `heteroplane serve` with the local provisioner; app `{APP}` on one
  `{INSTANCE_TYPE}`; queries sent open loop by `controlplane.clients.loadgen` (the code of
  `heteroplane loadgen`, engine {", ".join(engines)}), one seeded Poisson trace of
  {duration_s:g} s per level and run; P99 of the end-to-end latency at the client.
- The prediction: `estimator.simulator` on the same trace with the serving-path profile
  (calibrated as the service stored it by the warm-up's end, its factor and spread, as the
  planner reads it), the plan's fleet, batch size and dispatch (FCFS), plus per query its wait
  at the serving process (a queue serving each query in the CPU per query the service stored,
  `controlplane.policies.planner.front_waits_ms`) and a draw from the service's stored
  distribution of its own time (`controlplane.policies.planner.overhead_draws_ms`), what the
  planner adds; and that plus a draw from the client's path measured in the warm-up.
- rho is the share of the path's capacity: the instance's (1000 / the measured profile's mean
  round trip times the calibration's factor stored in the warm-up: the worker as the service
  knows it once warm; until 2026-12-06 the profile's mean before the factor, so that with a
  factor of 1.07 "90%" was 96% of the worker's live capacity) or the serving process's (1000 /
  its stored CPU per query), whichever is less; each setting says which; the goal is the
  predicted P99 within 15% of the measured one, judged on the median over the runs (the tables
  show measured / predicted).

**Fidelity goal (InferLine's Figure 9), the predicted P99 within 15% of the measured one: the
planner's prediction at {held} of {len(levels)} levels; with the client's path added, at
{client_held} of {len(levels)}.**

{WHY}

{chr(10).join(section(setting) for setting in settings)}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fidelity serving", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--service-ms",
        default=None,
        help=f"emulated compute times per batch, or none (default {DEFAULT_SERVICE_MS}, none"
        " with --from)",
    )
    parser.add_argument(
        "--user-model",
        default="",
        help="the user's ONNX model, queried over /v2 as json, binary or both (json,binary)",
    )
    parser.add_argument(
        "--cnn",
        choices=sorted(USER_CNNS),
        default="small",
        help="the user's CNN: small (tenths of a ms a query) or wide (a few ms); default"
        " %(default)s",
    )
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S)
    parser.add_argument(
        "--levels", default="0.3,0.6,0.9", help="shares of the plan's capacity (%(default)s)"
    )
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="runs per level (seeds)")
    parser.add_argument("--warmup-s", type=float, default=WARMUP_S)
    parser.add_argument(
        "--level-warmup-s",
        type=float,
        default=LEVEL_WARMUP_S,
        help="each level's own warm-up before its runs, s (default 0: none)",
    )
    parser.add_argument("--engine", choices=loadgen.ENGINES, default="httpx")
    parser.add_argument("--save", type=Path, help="also write the settings measured as JSON")
    parser.add_argument(
        "--from",
        dest="saved",
        type=Path,
        action="append",
        default=[],
        help="a file --save wrote: its settings instead of measuring (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", action="store_true", help="print the levels as JSON")
    parser.add_argument(
        "--service-setting",
        action="append",
        default=[],
        metavar="HETEROPLANE_X=V",
        help="one more setting for the service (repeatable), e.g. HETEROPLANE_TUNER_TICK_S=60",
    )
    args = parser.parse_args(argv)
    for item in args.service_setting:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("HETEROPLANE_"):
            parser.error(f"--service-setting: expected HETEROPLANE_NAME=VALUE, got {item!r}")
        SERVICE_SETTINGS[key] = value
    if args.service_ms is None:
        args.service_ms = "none" if args.saved else DEFAULT_SERVICE_MS
    try:
        utilisations = [float(part) for part in args.levels.split(",")]
        service_times = (
            []
            if args.service_ms.strip().lower() in ("", "none")
            else [float(part) for part in args.service_ms.split(",")]
        )
    except ValueError:
        parser.error("--levels and --service-ms take numbers separated by commas")
    encodings = [part.strip() for part in args.user_model.split(",") if part.strip()]
    if any(e not in ENCODINGS for e in encodings):
        parser.error(f"--user-model: {', '.join(ENCODINGS)} or both, got {args.user_model!r}")
    if not all(0.0 < u < 1.0 for u in utilisations):
        parser.error("--levels: shares in (0, 1)")
    if not all(t > 0 for t in service_times):
        parser.error("--service-ms: times > 0")
    if not (args.duration_s > 0 and args.runs >= 1 and args.warmup_s > 0):
        parser.error("--duration-s, --warmup-s: > 0; --runs: >= 1")
    if not args.level_warmup_s >= 0:
        parser.error("--level-warmup-s: >= 0")
    saved: list[dict[str, Any]] = []
    for path in args.saved:
        try:
            saved.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            parser.error(f"--from {path}: {error}")
    settings = [Setting.from_json(s) for document in saved for s in document["settings"]]
    commands = [c for document in saved for c in document["commands"]]
    if service_times or encodings:
        options = Options(
            utilisations,
            args.duration_s,
            args.runs,
            args.warmup_s,
            engine=args.engine,
            level_warmup_s=args.level_warmup_s,
        )
        measured = run(service_times, options, encodings=encodings, cnn=args.cnn)
        command = (
            f"python -m benchmarks.fidelity serving --service-ms {args.service_ms or 'none'}"
            + (f" --user-model {args.user_model}" if encodings else "")
            + (f" --cnn {args.cnn}" if encodings and args.cnn != "small" else "")
            + f" --duration-s {args.duration_s:g} --levels {args.levels} --runs {args.runs}"
            + (f" --engine {args.engine}" if args.engine != "httpx" else "")
            + (
                f" --level-warmup-s {args.level_warmup_s:g}"
                if args.level_warmup_s != LEVEL_WARMUP_S
                else ""
            )
            + "".join(f" --service-setting {item}" for item in args.service_setting)
        )
        settings += measured
        commands.append(command)
        if args.save is not None:
            document = {"commands": [command], "settings": [s.to_json() for s in measured]}
            args.save.write_text(json.dumps(document, indent=1), encoding="utf-8")
            local_service.log(f"wrote {args.save}")
    if not settings:
        parser.error("nothing to report: give --service-ms, --user-model or --from")
    # The settings' own trace length (a --from file's command says it), this run's otherwise.
    durations = {float(d) for c in commands for d in re.findall(r"--duration-s (\S+)", c)}
    text = markdown(settings, commands, durations.pop() if len(durations) == 1 else args.duration_s)
    args.out.write_text(text + kept_sections(args.out))
    local_service.log(f"wrote {args.out}")
    for setting in settings:
        for level in setting.levels:
            print(
                f"{setting.label}, rho {level.utilisation:g} ({level.rate_qps:.1f} qps):"
                f" P99 measured {spread_text(level.figure('measured_p99_ms'))} ms, planner"
                f" {spread_text(level.figure('predicted_p99_ms'))} ms (measured / predicted"
                f" {spread_text(level.ratios, 3)}), with the client's path"
                f" {spread_text(level.figure('client_path_p99_ms'))} ms"
                f" ({spread_text(level.client_ratios, 3)})"
            )
    if args.json:
        print(json.dumps(as_json(settings)))
    return 0 if all(s.holds for s in settings) else 1


# Sections other benchmarks write into the same page (benchmarks/fidelity/demo.py's and
# benchmarks/fidelity/cycle.py's).
KEPT_SECTIONS = (
    "## The demo at its planned rate",
    "## One demo load cycle, from the client's side",
)


def kept_sections(path: Path) -> str:
    """The sections of ``path`` that another benchmark owns, to be written back after this one's
    text (empty when the page has none)."""
    if not path.exists():
        return ""
    text = path.read_text(encoding="utf-8")
    kept = []
    for title in KEPT_SECTIONS:
        start = text.find(title)
        if start < 0:
            continue
        end = text.find("\n## ", start + len(title))
        kept.append(text[start : end if end >= 0 else len(text)].rstrip("\n"))
    return "".join(f"\n{section}\n" for section in kept)
