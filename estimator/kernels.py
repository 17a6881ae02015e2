"""Compiled hot loops of the simulator (numba).

Only loops that Python cannot run fast enough live here; each has a plain-Python twin elsewhere that
tests compare it with (the FCFS kernel against the event engine running :class:`FcfsPolicy`).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def _replay_path(
    key: np.ndarray, winner: np.ndarray, leaf_base: int, tree_base: int, width: int, leaf: int
) -> None:
    """Recompute the winners from ``leaf`` up to the root of one tournament tree.

    Node ``v`` (1 = root) of a tree of ``width`` leaves holds the leaf with the smallest key among
    its descendants; leaves of a left child come before those of a right child, so ``<=`` keeps the
    lower leaf (the lower instance id) on ties. One comparison per level, log2(width) in all.
    """
    node = (width + leaf) >> 1
    while node >= 1:
        left = winner[tree_base + 2 * node]
        right = winner[tree_base + 2 * node + 1]
        winner[tree_base + node] = (
            left if key[leaf_base + left] <= key[leaf_base + right] else right
        )
        node >>= 1


@numba.njit(cache=True)
def fcfs_kernel(
    arrival_s: np.ndarray,
    batch_size: np.ndarray,
    u: np.ndarray,
    seg_start: np.ndarray,
    seg_count: np.ndarray,
    seg_type: np.ndarray,
    seg_high: np.ndarray,
    seg_ident: np.ndarray,
    n_instances: int,
    table_s: np.ndarray,
    max_batch_queries: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FCFS from a central queue to the fastest idle instance, with batching.

    Instances are grouped in segments, one per instance type, fastest type first; each segment is
    a tournament tree over (free time, instance id), so its root is the instance idle the longest.
    The queue head starts at t = max(its arrival, the earliest free time); among segments whose
    root is free by t the fastest wins. The instance takes queued queries (arrived by t) while
    the count stays <= ``max_batch_queries`` and the summed batch size within its profile.
    Service time: ``table_s[type, summed batch, floor(u[head] K)]``.

    Returns start, finish and instance per query, and busy seconds per instance.
    """
    n = arrival_s.size
    n_segments = seg_start.size
    k_points = table_s.shape[2]
    # One tournament tree per segment: ``width`` leaves (a power of two, padded with +inf keys)
    # hold the free times; ``winner`` nodes 1..2 width-1 of each tree hold leaf positions.
    width = np.ones(n_segments, dtype=np.int64)
    for r in range(n_segments):
        while width[r] < seg_count[r]:
            width[r] *= 2
    leaf_base = np.zeros(n_segments, dtype=np.int64)
    tree_base = np.zeros(n_segments, dtype=np.int64)
    for r in range(1, n_segments):
        leaf_base[r] = leaf_base[r - 1] + width[r - 1]
        tree_base[r] = tree_base[r - 1] + 2 * width[r - 1]
    key = np.full(leaf_base[-1] + width[-1], np.inf)
    winner = np.zeros(tree_base[-1] + 2 * width[-1], dtype=np.int64)
    for r in range(n_segments):
        for i in range(seg_count[r]):
            key[leaf_base[r] + i] = 0.0
        for i in range(width[r]):
            winner[tree_base[r] + width[r] + i] = i
        for node in range(width[r] - 1, 0, -1):
            left = winner[tree_base[r] + 2 * node]
            right = winner[tree_base[r] + 2 * node + 1]
            keep_left = key[leaf_base[r] + left] <= key[leaf_base[r] + right]
            winner[tree_base[r] + node] = left if keep_left else right
    start = np.empty(n)
    finish = np.empty(n)
    served_by = np.empty(n, dtype=np.int64)
    busy_s = np.zeros(n_instances)
    head = 0
    while head < n:
        arrival = arrival_s[head]
        earliest = np.inf
        for r in range(n_segments):
            free = key[leaf_base[r] + winner[tree_base[r] + 1]]
            if free < earliest:
                earliest = free
        t = arrival if arrival > earliest else earliest
        chosen = 0
        for r in range(n_segments):
            if key[leaf_base[r] + winner[tree_base[r] + 1]] <= t:
                chosen = r
                break
        leaf = winner[tree_base[chosen] + 1]
        total = batch_size[head]
        taken = 1
        cap = seg_high[chosen]
        while (
            head + taken < n
            and taken < max_batch_queries
            and arrival_s[head + taken] <= t
            and total + batch_size[head + taken] <= cap
        ):
            total += batch_size[head + taken]
            taken += 1
        service = table_s[seg_type[chosen], total, int(u[head] * k_points)]
        done = t + service
        instance = seg_ident[seg_start[chosen] + leaf]
        for q in range(head, head + taken):
            start[q] = t
            finish[q] = done
            served_by[q] = instance
        busy_s[instance] += service
        key[leaf_base[chosen] + leaf] = done
        _replay_path(key, winner, leaf_base[chosen], tree_base[chosen], width[chosen], leaf)
        head += taken
    return start, finish, served_by, busy_s
