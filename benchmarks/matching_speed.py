"""How fast the Kairos dispatcher decides, and how fast the simulator runs it.

    .venv/bin/python benchmarks/matching_speed.py [--quick] [--json] [--queries N]

- Decision time of one round with 32 queued queries x 16 instances and 256 x 128 (the round's
  row cap is twice the instances), on 2,000 (500) random states: queue batch sizes from the
  Kairos mix, waits uniform in [0, 300] ms, one base instance in eight, about half the instances
  idle and the rest busy for up to 300 ms. Timed per call: the policy's whole ``dispatch`` (read
  the queue and the fleet, compiled predictions, the solve, dispatches: the penalised matrix and
  SciPy at 32 x 16, the chain flow at 256 x 128, as ``FLOW_FROM_INSTANCES`` picks) and the
  library path (``build_cost_matrix`` in numpy + ``solve_assignment``), median and p99; for the
  policy round also the thread's CPU time per call (``*_policy_round_cpu_*``), which leaves out
  the time the process was preempted: when other jobs load the cores, the wall-clock p99 of
  every decider here rises to the scheduler's slices while the CPU-time p99 stays the round's.
- The solvers alone on those rounds: SciPy's ``linear_sum_assignment`` on the matrix, the chain
  flow (``chain_assignment_kernel``) on the same inputs and, when installed, ``lap.lapjv``
  (padded to square).
- The Kairos policy is the tail-aware one the estimator builds (``policy_factory("kairos")``: QoS
  checks on the profiled p99, as a ratio to the online mean); without the shared data, synthetic
  lines and constant tail ratios stand in.
- Simulated queries per second of the Kairos policy in the event engine on the paper's rm2
  configuration (1 g4dn.xlarge + 13 r5n.large, QoS 350 ms, the Kairos batch mix, Poisson
  arrivals) at 100 and 130 qps (capacity is about 130), best of 3 after a warm-up, with the split
  of the time between the policy (``dispatch`` + ``observe``) and the engine; FCFS through the
  same engine for comparison. Needs the shared data (../shared/data).

Goals: 32 x 16 median <= 50 us; 256 x 128 p99 <= 1 ms; >= 50,000 simulated queries/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from estimator.batches import parse_batch_distribution
from estimator.policies import policy_factory
from estimator.profiles import load_profiles
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals
from matching.assignment import solve_assignment
from matching.chain_flow import chain_assignment_kernel
from matching.cost import SAFETY, build_cost_matrix
from matching.fcfs import FcfsPolicy
from matching.kairos import KairosPolicy
from matching.latency_model import LatencyModel
from matching.policy import (
    Dispatch,
    DispatchPolicy,
    InstanceView,
    QueuedQuery,
    StageContext,
    queries_per_call,
)

try:  # imported as benchmarks.matching_speed
    from benchmarks.paths import kairos_samples, shared_dir
    from benchmarks.sizes import add_quick, chosen
except ModuleNotFoundError:  # run as a script: the sibling modules
    from paths import kairos_samples, shared_dir
    from sizes import add_quick, chosen  # type: ignore[no-redef]

SHARED = shared_dir()
PROFILES = kairos_samples()
BASE, AUX = "g4dn.xlarge", "r5n.large"
PRICES = {BASE: 0.526, AUX: 0.148}
QOS_MS = 350.0
# rm2's mean latency is close to linear in the batch size; these lines stand in for the
# profiles when the shared data is missing (the decision benchmark only needs plausible costs).
SYNTHETIC_POINTS = {BASE: [(10, 5.4), (1000, 260.0)], AUX: [(10, 5.7), (1000, 405.0)]}
SYNTHETIC_TAIL_RATIO = {BASE: np.array([1.01]), AUX: np.array([1.03])}

TailRatio = dict[str, np.ndarray]


@dataclass
class BenchInstance:
    index: int
    instance_type: str
    busy_until_s: float
    speed_rank: int = 0
    idle_since_s: float = 0.0
    max_batch_size: int = 1000

    def is_idle(self, now_s: float) -> bool:
        return self.busy_until_s <= now_s


@dataclass(frozen=True)
class State:
    queue: list[QueuedQuery]
    instances: list[BenchInstance]


def random_states(
    count: int, n_queue: int, n_instances: int, rng: np.random.Generator
) -> list[State]:
    mix = parse_batch_distribution("kairos")
    now = 100.0
    states = []
    for _ in range(count):
        sizes = mix.sample(n_queue, rng).tolist()
        waits_s = np.sort(rng.uniform(0.0, 0.3, size=n_queue))[::-1].tolist()
        queue = [QueuedQuery(q, sizes[q], now - waits_s[q], now) for q in range(n_queue)]
        busy = np.where(rng.random(n_instances) < 0.5, now, now + rng.uniform(0, 0.3, n_instances))
        instances = [
            BenchInstance(j, BASE if j % 8 == 0 else AUX, float(busy[j]))
            for j in range(n_instances)
        ]
        states.append(State(queue, instances))
    return states


def percentiles_us(samples_ns: Sequence[int]) -> tuple[float, float]:
    values = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return float(np.median(values)), float(np.percentile(values, 99))


def time_each(
    states: Sequence[State], decide: Callable[[State], object]
) -> tuple[list[int], list[int]]:
    """Wall-clock and thread CPU time of each call, in ns. The CPU clock brackets the wall clock,
    so the wall figures do not pay for reading it; it stops while the thread is preempted, which
    on a shared machine tells the scheduler's share of a wall-clock p99 from the algorithm's."""
    for state in states[: min(50, len(states))]:
        decide(state)  # warm-up: compiled code loads, caches fill
    wall, cpu = [], []
    for state in states:
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        decide(state)
        wall.append(time.perf_counter_ns() - start)
        cpu.append(time.thread_time_ns() - cpu_start)
    return wall, cpu


Inputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def library_inputs(state: State, model: LatencyModel, tail_ratio: TailRatio) -> Inputs:
    """l_ij, r_j, h_j, w_i and the tail l_ij k_j(b_i) of a state, for :func:`build_cost_matrix`."""
    rows = state.queue[: 2 * len(state.instances)]
    types = [inst.instance_type for inst in state.instances]
    by_type = {t: np.array([model.predict_ms(t, q.batch_size) for q in rows]) for t in set(types)}
    sizes = np.array([q.batch_size for q in rows])
    k = {t: tail_ratio[t][np.minimum(sizes, tail_ratio[t].size - 1)] for t in set(types)}
    b_max = model.max_batch_size
    base_ms = model.predict_ms(BASE, b_max)
    return (
        np.stack([by_type[t] for t in types], axis=1),
        np.array([max(i.busy_until_s - 100.0, 0.0) * 1000 for i in state.instances]),
        np.array([base_ms / model.predict_ms(t, b_max) for t in types]),
        np.array([(100.0 - q.arrival_s) * 1000 for q in rows]),
        np.stack([by_type[t] * k[t] for t in types], axis=1),
    )


def flow_inputs(state: State, inputs: Inputs) -> tuple[np.ndarray, ...]:
    """The same round as :func:`chain_assignment_kernel` takes it: latencies per fleet type."""
    latency, remaining, h, waited, tail = inputs
    types = [inst.instance_type for inst in state.instances]
    fleet = list(dict.fromkeys(types))
    first = [types.index(t) for t in fleet]
    column_type = np.array([fleet.index(t) for t in types], dtype=np.int64)
    return latency[:, first], tail[:, first], column_type, remaining, h, waited


def library_costs(inputs: Inputs) -> np.ndarray:
    latency, remaining, h, waited, tail = inputs
    return build_cost_matrix(latency, remaining, h, waited, QOS_MS, tail_ms=tail).costs


def size_figures(
    label: str,
    states: list[State],
    model: LatencyModel,
    tail_ratio: TailRatio,
    rng: np.random.Generator,
) -> dict[str, float]:
    context = StageContext(max_batch_queries=1, qos_ms=QOS_MS)
    policy = KairosPolicy(BASE, model, tail_ratio=tail_ratio)
    inputs = {id(state): library_inputs(state, model, tail_ratio) for state in states}
    matrices = {key: library_costs(args) for key, args in inputs.items()}
    flows = {id(state): flow_inputs(state, inputs[id(state)]) for state in states}
    uniform = {key: rng.uniform(0, 1000, size=m.shape) for key, m in matrices.items()}

    def policy_round(state: State) -> list[Dispatch]:
        instances: list[InstanceView] = list(state.instances)
        return policy.dispatch(100.0, state.queue, instances, context)

    deciders: list[tuple[str, Callable[[State], object]]] = [
        ("policy_round", policy_round),
        (
            "numpy_costs_and_solve",
            lambda s: solve_assignment(library_costs(inputs[id(s)])),
        ),
        ("scipy_solve_only", lambda s: linear_sum_assignment(matrices[id(s)])),
        ("flow_solve_only", lambda s: chain_assignment_kernel(*flows[id(s)], QOS_MS, SAFETY)),
        ("scipy_on_uniform_random", lambda s: linear_sum_assignment(uniform[id(s)])),
    ]
    try:
        import lap  # type: ignore[import-not-found]  # optional: only to compare
    except ImportError:
        pass
    else:
        deciders.append(
            (
                "lap_solve_only",
                lambda s: lap.lapjv(matrices[id(s)], extend_cost=True, return_cost=False),
            )
        )
    figures: dict[str, float] = {}
    for name, decide in deciders:
        wall, cpu = time_each(states, decide)
        median, p99 = percentiles_us(wall)
        figures[f"{label}_{name}_median_us"] = median
        figures[f"{label}_{name}_p99_us"] = p99
        if name == "policy_round":
            median, p99 = percentiles_us(cpu)
            figures[f"{label}_{name}_cpu_median_us"] = median
            figures[f"{label}_{name}_cpu_p99_us"] = p99
    return figures


def decision_figures(
    model: LatencyModel,
    tail_ratio: TailRatio,
    rng: np.random.Generator,
    states: tuple[int, int] = (2000, 500),
) -> dict[str, float]:
    """Decision times at 32 x 16 and 256 x 128, on ``states`` random states of each."""
    figures: dict[str, float] = {}
    for (n_queue, n_instances), count in zip(((32, 16), (256, 128)), states, strict=True):
        states = random_states(count, n_queue, n_instances, rng)
        figures.update(size_figures(f"{n_queue}x{n_instances}", states, model, tail_ratio, rng))
    return figures


def rm2_kairos() -> KairosPolicy:
    """A fresh Kairos policy for rm2 on the benchmark's types, as the estimator builds it."""
    profile_set = load_profiles(PROFILES)
    profiles = {t: profile_set.get_profile("rm2", t) for t in (BASE, AUX)}
    policy = policy_factory("kairos", profiles, [BASE])()
    assert isinstance(policy, KairosPolicy)
    return policy


class TimedPolicy:
    """Wraps a policy and counts the time spent inside it (adds ~0.2 us per call of its own)."""

    def __init__(self, inner: DispatchPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.type_order = getattr(inner, "type_order", ())
        self.policy_s = 0.0

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        start = time.perf_counter()
        decided = self.inner.dispatch(now_s, queue, instances, context)
        self.policy_s += time.perf_counter() - start
        return decided

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        start = time.perf_counter()
        self.inner.observe(instance_type, batch_size, latency_ms)
        self.policy_s += time.perf_counter() - start

    def queries_per_call(self, now_s: float, batch_cap: int) -> int:
        return queries_per_call(self.inner, now_s, batch_cap)


def simulation_figures(
    n_queries: int, repeats: int = 3, rates_qps: tuple[int, ...] = (100, 130)
) -> dict[str, float]:
    """Simulated queries/s of Kairos and FCFS on rm2 at each rate (best of ``repeats``)."""
    profile_set = load_profiles(PROFILES)
    profiles = {t: profile_set.get_profile("rm2", t) for t in (BASE, AUX)}
    make_kairos = policy_factory("kairos", profiles, [BASE])
    instances = (InstanceSpec(BASE),) + (InstanceSpec(AUX),) * 13
    figures: dict[str, float] = {}
    for rate in rates_qps:
        rng = np.random.default_rng(rate)
        arrivals = poisson_arrivals(float(rate), n_queries / rate * 1.2, rng)[:n_queries]
        trace = Trace(arrivals, parse_batch_distribution("kairos").sample(arrivals.size, rng))

        def run(policy: object, trace: Trace = trace) -> float | None:
            stage = Stage("rm2", instances, profiles, policy, max_batch_queries=1)  # type: ignore[arg-type]
            result = simulate(
                trace,
                [stage],
                np.random.default_rng(1),
                prices_usd_per_hr=PRICES,
                qos_ms=QOS_MS,
                engine="events",
            )
            return result.summary().attainment

        for name, make in (
            ("kairos", make_kairos),
            ("fcfs", FcfsPolicy),
        ):
            run(make())  # warm-up
            best_s = np.inf
            attainment = None
            for _ in range(repeats):
                start = time.perf_counter()
                attainment = run(make())
                best_s = min(best_s, time.perf_counter() - start)
            timed = TimedPolicy(make())
            start = time.perf_counter()
            run(timed)
            wrapped_s = time.perf_counter() - start
            n = len(trace)
            figures[f"{name}_{rate}qps_queries_per_s"] = n / best_s
            figures[f"{name}_{rate}qps_attainment"] = float(attainment or 0.0)
            figures[f"{name}_{rate}qps_policy_us_per_query"] = timed.policy_s / n * 1e6
            figures[f"{name}_{rate}qps_engine_us_per_query"] = (
                (wrapped_s - timed.policy_s) / n * 1e6
            )
    return figures


def measure(
    queries: int = 100_000,
    *,
    states: tuple[int, int] = (2000, 500),
    repeats: int = 3,
    rates_qps: tuple[int, ...] = (100, 130),
) -> dict[str, float]:
    """The figures (see the module docstring): decision times on ``states`` random states at
    32 x 16 and 256 x 128, and, when the shared data is here, the simulated queries/s of
    ``queries`` queries at each rate (best of ``repeats``)."""
    if PROFILES.exists():
        kairos = rm2_kairos()
        model, tail_ratio = kairos.latency, kairos.tail_ratio
    else:
        model, tail_ratio = LatencyModel(SYNTHETIC_POINTS), SYNTHETIC_TAIL_RATIO
    figures = decision_figures(model, tail_ratio, np.random.default_rng(0), states)
    if PROFILES.exists():
        figures.update(simulation_figures(queries, repeats, rates_qps))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--queries", type=int, default=None, help="default 100,000")
    add_quick(parser)
    args = parser.parse_args()
    sizes = chosen(args)
    if args.queries is None:
        args.queries = sizes.matching_queries
    have_data = PROFILES.exists()
    figures = measure(
        args.queries,
        states=sizes.matching_states,
        repeats=sizes.matching_repeats,
        rates_qps=sizes.matching_rates_qps,
    )
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"matching speed on {os.cpu_count()} cores (median / p99 per round, microseconds)")
    for label in ("32x16", "256x128"):
        parts = [
            f"{what} {figures[f'{label}_{key}_median_us']:.1f}"
            f" / {figures[f'{label}_{key}_p99_us']:.1f}"
            for what, key in (
                ("policy round", "policy_round"),
                ("numpy costs + solve", "numpy_costs_and_solve"),
                ("scipy solve", "scipy_solve_only"),
                ("chain flow", "flow_solve_only"),
                ("lap solve", "lap_solve_only"),
                ("scipy on uniform random costs", "scipy_on_uniform_random"),
            )
            if f"{label}_{key}_median_us" in figures
        ]
        parts.append(
            f"policy round in CPU time {figures[f'{label}_policy_round_cpu_median_us']:.1f}"
            f" / {figures[f'{label}_policy_round_cpu_p99_us']:.1f}"
        )
        print(f"  {label:>7}: " + "; ".join(parts))
    if not have_data:
        print(f"  (no simulation figures: the shared data is not at {PROFILES})", file=sys.stderr)
        return 0
    print(f"  simulator, rm2 on 1 {BASE} + 13 {AUX}, {args.queries:,} queries, event engine:")
    for rate in sizes.matching_rates_qps:
        for name in ("kairos", "fcfs"):
            key = f"{name}_{rate}qps"
            print(
                f"    {name:>6} at {rate} qps:"
                f" {figures[f'{key}_queries_per_s'] / 1e3:5.1f} k queries/s"
                f" (policy {figures[f'{key}_policy_us_per_query']:.1f} us/query,"
                f" engine {figures[f'{key}_engine_us_per_query']:.1f} us/query),"
                f" {100 * figures[f'{key}_attainment']:.2f}% within QoS"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
