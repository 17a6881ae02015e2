"""The Kairos oracle: an offline schedule that knows every query in advance.

Kairos section 7 (ORCL): take a sequence of queries drawn from the batch-size mix and sort it by
batch size. Whenever a base instance is free it serves the next largest query; whenever an
auxiliary instance is free, the next smallest, if that meets QoS on its type (else it stays idle
for good, since every query left is at least as large). Nothing waits and nothing violates QoS;
the oracle's throughput is the number of queries over the time to serve them all. It bounds what
any online dispatcher can reach on the same fleet, and is not realisable (it needs the future).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from estimator.errors import SimulationError


def oracle_throughput_qps(
    batch_sizes: np.ndarray,
    instance_types: Sequence[str],
    mean_latency_ms: Mapping[str, np.ndarray],
    qos_ms: float,
    base_types: Sequence[str],
) -> float:
    """Queries per second of the ORCL schedule of ``batch_sizes`` on the given instances.

    ``mean_latency_ms[type][b]`` is the mean latency of batch size ``b`` (NaN where unmeasured).
    """
    sizes = np.sort(np.asarray(batch_sizes, dtype=np.int64))
    if sizes.size == 0:
        raise SimulationError("the oracle needs at least one query")
    base = frozenset(base_types)
    if not any(t in base for t in instance_types):
        raise SimulationError("the oracle needs at least one base instance")
    smallest, largest = 0, sizes.size - 1
    free = [(0.0, index) for index in range(len(instance_types))]
    heapq.heapify(free)
    makespan_ms = 0.0
    while smallest <= largest:
        now_ms, index = heapq.heappop(free)
        table = mean_latency_ms[instance_types[index]]
        if instance_types[index] in base:
            size = int(sizes[largest])
            largest -= 1
        else:
            size = int(sizes[smallest])
            latency = float(table[size]) if size < table.size else np.nan
            if not latency <= qos_ms:  # too slow (or unmeasured) for every query left
                continue
            smallest += 1
        latency_ms = float(table[size])
        if not latency_ms <= qos_ms:
            raise SimulationError(
                f"a base instance ({instance_types[index]}) misses QoS at batch size {size}"
            )
        makespan_ms = max(makespan_ms, now_ms + latency_ms)
        heapq.heappush(free, (now_ms + latency_ms, index))
    return sizes.size / (makespan_ms / 1000.0)
