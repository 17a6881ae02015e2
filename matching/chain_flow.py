"""Kairos' round solved as a min-cost flow over instance-type chains (same optimum, less work).

The cost matrix of :mod:`matching.cost` has a structure the dense solver cannot see. Within one
instance type (one h), column j differs from the others only by its remaining busy time r_j:

    cost_ij = h (r_j + l_i) + P[level_ij],    level_ij = 0 (fits), 1 (margin) or 2 (miss),

and level_ij is a step function of r_j that never decreases (a later finish can only be worse).
So sort a type's columns by r_j into a *chain* of blocks (a block: the columns of one type with
the same r_j, e.g. all its idle instances); then query i's options on that chain are at most three
prefixes: the blocks where it fits, at cost h l_i; those where it fits but lands in the margin,
at h l_i + P_margin; and all of them at h l_i + P_miss. With

    source -> query i (capacity 1, cost 0),
    query i -> the last block of each of its prefixes (capacity 1, cost h l_i + P_level),
    block b -> block b - 1 of the same chain (capacity unbounded, cost 0),
    block b -> sink (capacity: its columns, cost h r_b),

every assignment is a flow of min(m, n) units at the matrix's cost of it, and every such flow is
an assignment that costs at most the flow (a unit that enters a chain at a prefix's last block may
settle on any block of that prefix, at that prefix's level or a better one). So an optimal flow
is an optimal assignment of the matrix: the same minimum, hence the same number of QoS misses,
then of margins, and the same total usage (Kairos Eqs. 2, 5 and 8; the penalties dominate).

The graph has about m + n nodes and 3 m T + 2 n edges for T types, against the matrix's m n
entries, and the instances of a type, which the dense solver sees as many columns pricing the
queries alike (what makes its augmenting paths long), are one chain here (docs/matching.md, "The
chain flow"). When every column is used (m >= n) the h r_b add up to the same total for every
assignment and are left out.

The solver is successive shortest paths (Ahuja, Magnanti and Orlin, "Network Flows", 1993,
section 9.7): Dijkstra on reduced costs with node potentials. Unassigned queries are sources at
distance 0, so each search starts from every block's cheapest unassigned entry, and a query once
assigned stays assigned (a shortest path never returns to the source). After each search, every
further path of zero reduced cost is taken too (the primal-dual method, section 9.8): batch sizes
come from a discrete mix, so many paths cost exactly the same (the benchmark's 256 x 128 rounds
send 128 units in about 23 searches). "Zero" allows a few ulps of the largest total cost, far
below the 1 ms by which the penalties dominate.

Ties. The optimum is rarely unique: with at least as many queries as instances every instance is
used, so the r_j part of the cost is the same for every assignment, and which of two queries that
fit everywhere waits for a busy instance and which runs now is a tie (the dense solver breaks it by
floating-point rounding: permuting the columns changes its choice). Here, within a chain, the
queries are placed by the last block they may use, then by queue order, onto the blocks in order
of r_j and the columns of a block in index order: the most constrained and the oldest queries take
the instances that are free now.

Rounding. The flow sums h l_i and h r_j where the matrix holds h (r_j + l_i); the levels and the
penalties are computed with the matrix's own expressions, so the numbers of misses and margins of
the two optima are equal, and their usages agree to rounding (tests/unit/test_kairos_round.py).
"""

from __future__ import annotations

import numba
import numpy as np

from matching.cost import PENALTY_SLACK_MS


@numba.njit(cache=True)
def _level(budget_ms: float, remaining_ms: float, tail_ms: float, margin_ms: float) -> int:
    """0 (fits), 1 (inside the safety margin) or 2 (misses QoS), as :func:`costs_kernel`."""
    if budget_ms <= 0.0:
        return 0
    slack = budget_ms - (remaining_ms + tail_ms)
    if slack < 0.0:
        return 2
    if slack < margin_ms:
        return 1
    return 0


@numba.njit(cache=True)
def _blocks_below(
    level: int,
    first: int,
    count: int,
    block_remaining_ms: np.ndarray,
    budget_ms: float,
    tail_ms: float,
    margin_ms: float,
) -> int:
    """How many of a chain's blocks (in order of r) have a level below ``level``."""
    lo = 0
    hi = count
    while lo < hi:
        mid = (lo + hi) // 2
        if _level(budget_ms, block_remaining_ms[first + mid], tail_ms, margin_ms) >= level:
            hi = mid
        else:
            lo = mid + 1
    return lo


@numba.njit(cache=True)
def _push(keys: np.ndarray, nodes: np.ndarray, size: int, key: float, node: int) -> int:
    """Binary-heap insert; returns the new size."""
    k = size
    while k > 0:
        parent = (k - 1) // 2
        if keys[parent] <= key:
            break
        keys[k] = keys[parent]
        nodes[k] = nodes[parent]
        k = parent
    keys[k] = key
    nodes[k] = node
    return size + 1


@numba.njit(cache=True)
def _pop(keys: np.ndarray, nodes: np.ndarray, size: int) -> int:
    """Binary-heap removal of the root (read it first); returns the new size."""
    size -= 1
    key = keys[size]
    node = nodes[size]
    k = 0
    while True:
        child = 2 * k + 1
        if child >= size:
            break
        if child + 1 < size and keys[child + 1] < keys[child]:
            child += 1
        if keys[child] >= key:
            break
        keys[k] = keys[child]
        nodes[k] = nodes[child]
        k = child
    if size > 0:
        keys[k] = key
        nodes[k] = node
    return size


@numba.njit(cache=True)
def _chains(
    column_type: np.ndarray, heterogeneity: np.ndarray, remaining_ms: np.ndarray
) -> tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray
]:
    """Columns grouped into chains (one per type and h) and blocks (equal r within a chain).

    Returns ``columns`` (by chain, then r, then index), per chain its type, h, first block and
    number of blocks, and per block its r and its ``columns[block_start[b]:][:block_size[b]]``.
    """
    n = column_type.size
    chain_of = np.empty(n, dtype=np.int64)
    chain_type = np.empty(n, dtype=np.int64)
    chain_h = np.empty(n)
    n_chains = 0
    for j in range(n):
        c = -1
        for q in range(n_chains):
            if chain_type[q] == column_type[j] and chain_h[q] == heterogeneity[j]:
                c = q
                break
        if c < 0:
            c = n_chains
            chain_type[c] = column_type[j]
            chain_h[c] = heterogeneity[j]
            n_chains += 1
        chain_of[j] = c
    chain_start = np.zeros(n_chains + 1, dtype=np.int64)
    for j in range(n):
        chain_start[chain_of[j] + 1] += 1
    chain_start = np.cumsum(chain_start)
    fill = chain_start[:n_chains].copy()
    columns = np.empty(n, dtype=np.int64)
    for j in np.argsort(remaining_ms, kind="mergesort"):
        columns[fill[chain_of[j]]] = j
        fill[chain_of[j]] += 1
    block_remaining = np.empty(n)
    block_start = np.empty(n + 1, dtype=np.int64)
    chain_first_block = np.empty(n_chains + 1, dtype=np.int64)
    n_blocks = 0
    for c in range(n_chains):
        chain_first_block[c] = n_blocks
        for p in range(chain_start[c], chain_start[c + 1]):
            r = remaining_ms[columns[p]]
            if p == chain_start[c] or r != block_remaining[n_blocks - 1]:
                block_remaining[n_blocks] = r
                block_start[n_blocks] = p
                n_blocks += 1
    chain_first_block[n_chains] = n_blocks
    block_start[n_blocks] = n
    return (
        columns,
        chain_type[:n_chains].copy(),
        chain_h[:n_chains].copy(),
        chain_first_block,
        block_remaining[:n_blocks].copy(),
        block_start[: n_blocks + 1].copy(),
        np.diff(block_start[: n_blocks + 1]),
        np.diff(chain_first_block),
    )


@numba.njit(cache=True)
def _shortest_path(
    m: int,
    block_chain: np.ndarray,
    chain_first_block: np.ndarray,
    block_size: np.ndarray,
    sink_cost: np.ndarray,
    edge_row: np.ndarray,
    edge_block: np.ndarray,
    edge_cost: np.ndarray,
    row_first_edge: np.ndarray,
    entries: np.ndarray,
    entry_start: np.ndarray,
    pointer: np.ndarray,
    potential: np.ndarray,
    row_edge: np.ndarray,
    used: np.ndarray,
    down: np.ndarray,
    in_head: np.ndarray,
    in_next: np.ndarray,
    pred_edge: np.ndarray,
    pred_block: np.ndarray,
    dist: np.ndarray,
    done: np.ndarray,
    heap_keys: np.ndarray,
    heap_nodes: np.ndarray,
) -> bool:
    """Dijkstra on reduced costs from every unassigned query to the sink, then the potentials
    (Ahuja et al. 9.7: a node the search settled gains its distance, the others the sink's).
    Fills the predecessors; False when the sink is out of reach."""
    n_blocks = block_size.size
    sink = m + n_blocks
    dist[:] = np.inf
    done[:] = False
    size = 0
    for b in range(n_blocks):  # each block's cheapest entry from an unassigned query
        p = pointer[b]
        while p < entry_start[b + 1] and row_edge[edge_row[entries[p]]] >= 0:
            p += 1
        pointer[b] = p
        if p < entry_start[b + 1]:
            e = entries[p]
            dist[m + b] = edge_cost[e] - potential[m + b]
            pred_edge[m + b] = e
            pred_block[m + b] = -1
            size = _push(heap_keys, heap_nodes, size, dist[m + b], m + b)
    while size > 0:
        d = heap_keys[0]
        v = heap_nodes[0]
        size = _pop(heap_keys, heap_nodes, size)
        if done[v] or d > dist[v]:
            continue
        done[v] = True
        if v == sink:
            break
        d += potential[v]  # reduced cost of (v, w): cost + potential[v] - potential[w]
        if v >= m:
            b = v - m
            c = block_chain[b]
            if b > chain_first_block[c]:  # down the chain
                w = v - 1
                nd = d - potential[w]
                if nd < dist[w] and not done[w]:
                    dist[w] = nd
                    pred_edge[w] = -1
                    pred_block[w] = b
                    size = _push(heap_keys, heap_nodes, size, nd, w)
            if b + 1 < chain_first_block[c + 1] and down[b + 1] > 0:  # back up the chain
                w = v + 1
                nd = d - potential[w]
                if nd < dist[w] and not done[w]:
                    dist[w] = nd
                    pred_edge[w] = -1
                    pred_block[w] = b
                    size = _push(heap_keys, heap_nodes, size, nd, w)
            if used[b] < block_size[b]:
                nd = d + sink_cost[b] - potential[sink]
                if nd < dist[sink]:
                    dist[sink] = nd
                    pred_block[sink] = b
                    size = _push(heap_keys, heap_nodes, size, nd, sink)
            e = in_head[b]
            while e >= 0:  # back along a used edge, to the query that took it
                w = edge_row[e]
                nd = d - edge_cost[e] - potential[w]
                if nd < dist[w] and not done[w]:
                    dist[w] = nd
                    pred_block[w] = b
                    size = _push(heap_keys, heap_nodes, size, nd, w)
                e = in_next[e]
        else:
            for e in range(row_first_edge[v], row_first_edge[v + 1]):
                if e == row_edge[v]:
                    continue
                w = m + edge_block[e]
                nd = d + edge_cost[e] - potential[w]
                if nd < dist[w] and not done[w]:
                    dist[w] = nd
                    pred_edge[w] = e
                    pred_block[w] = -1
                    size = _push(heap_keys, heap_nodes, size, nd, w)
    reached = dist[sink]
    if reached == np.inf:
        return False
    for v in range(sink + 1):
        if v < m and row_edge[v] < 0:
            continue  # an unassigned query stays a source, at potential 0
        potential[v] += dist[v] if done[v] else reached
    return True


@numba.njit(cache=True)
def _augment(
    m: int,
    b: int,
    edge_row: np.ndarray,
    edge_block: np.ndarray,
    row_edge: np.ndarray,
    used: np.ndarray,
    down: np.ndarray,
    in_head: np.ndarray,
    in_next: np.ndarray,
    in_prev: np.ndarray,
    pred_edge: np.ndarray,
    pred_block: np.ndarray,
) -> None:
    """Send one unit along the predecessors: into the sink from block ``b`` (which has room),
    back to the query that leaves the source."""
    used[b] += 1
    while True:
        e = pred_edge[m + b]
        if e < 0:  # along the chain
            previous = pred_block[m + b]
            if previous == b + 1:
                down[b + 1] += 1
            else:
                down[b] -= 1
            b = previous
            continue
        i = edge_row[e]
        old = row_edge[i]
        row_edge[i] = e
        in_prev[e] = -1
        in_next[e] = in_head[b]
        if in_head[b] >= 0:
            in_prev[in_head[b]] = e
        in_head[b] = e
        if old < 0:
            return  # the path's first query, fresh from the source
        if in_prev[old] >= 0:
            in_next[in_prev[old]] = in_next[old]
        else:
            in_head[edge_block[old]] = in_next[old]
        if in_next[old] >= 0:
            in_prev[in_next[old]] = in_prev[old]
        b = edge_block[old]


@numba.njit(cache=True)
def _tied_paths(
    m: int,
    limit: int,
    tie_ms: float,
    phase: int,
    block_chain: np.ndarray,
    chain_first_block: np.ndarray,
    block_size: np.ndarray,
    sink_cost: np.ndarray,
    edge_row: np.ndarray,
    edge_block: np.ndarray,
    edge_cost: np.ndarray,
    row_first_edge: np.ndarray,
    entries: np.ndarray,
    entry_start: np.ndarray,
    pointer: np.ndarray,
    potential: np.ndarray,
    row_edge: np.ndarray,
    used: np.ndarray,
    down: np.ndarray,
    in_head: np.ndarray,
    in_next: np.ndarray,
    in_prev: np.ndarray,
    pred_edge: np.ndarray,
    pred_block: np.ndarray,
    visit: np.ndarray,
    dead: np.ndarray,
    stack: np.ndarray,
    stage: np.ndarray,
    cursor: np.ndarray,
    attempts: np.ndarray,
) -> int:
    """After a search, send up to ``limit`` more units along paths of zero reduced cost (each
    edge within ``tie_ms`` of it): they are as short as the path just taken, so the flow stays
    optimal for its value (the primal-dual method, Ahuja et al. 9.8). A depth-first search from
    each block with an admissible entry; a node it leaves without reaching the sink is dead for
    this phase. Returns how many units it sent."""
    n_blocks = block_size.size
    sink = m + n_blocks
    sent = 0
    for b0 in range(n_blocks):
        while sent < limit and dead[m + b0] != phase:
            p = pointer[b0]
            while p < entry_start[b0 + 1] and row_edge[edge_row[entries[p]]] >= 0:
                p += 1
            pointer[b0] = p
            if p == entry_start[b0 + 1] or edge_cost[entries[p]] - potential[m + b0] > tie_ms:
                break
            pred_edge[m + b0] = entries[p]
            pred_block[m + b0] = -1
            attempts[0] += 1
            stamp = attempts[0]
            top = 0
            stack[0] = m + b0
            stage[0] = 0
            cursor[0] = -1
            visit[m + b0] = stamp
            end = -1
            while top >= 0:
                v = stack[top]
                pv = potential[v]
                nxt = -1
                if v >= m:
                    # A block's edges in turn: the sink, down, up, back along used edges.
                    b = v - m
                    c = block_chain[b]
                    if stage[top] == 0:
                        stage[top] = 1
                        if (
                            used[b] < block_size[b]
                            and sink_cost[b] + pv - potential[sink] <= tie_ms
                        ):
                            end = b
                            break
                    if stage[top] == 1:
                        stage[top] = 2
                        w = v - 1
                        if (
                            b > chain_first_block[c]
                            and visit[w] != stamp
                            and dead[w] != phase
                            and pv - potential[w] <= tie_ms
                        ):
                            nxt = w
                            pred_edge[w] = -1
                            pred_block[w] = b
                    if nxt < 0 and stage[top] == 2:
                        stage[top] = 3
                        w = v + 1
                        if (
                            b + 1 < chain_first_block[c + 1]
                            and down[b + 1] > 0
                            and visit[w] != stamp
                            and dead[w] != phase
                            and pv - potential[w] <= tie_ms
                        ):
                            nxt = w
                            pred_edge[w] = -1
                            pred_block[w] = b
                    if nxt < 0 and stage[top] == 3:
                        e = in_head[b] if cursor[top] < 0 else in_next[cursor[top]]
                        while e >= 0:
                            w = edge_row[e]
                            if (
                                visit[w] != stamp
                                and dead[w] != phase
                                and pv - edge_cost[e] - potential[w] <= tie_ms
                            ):
                                nxt = w
                                pred_block[w] = b
                                break
                            e = in_next[e]
                        cursor[top] = e
                        if e < 0:
                            stage[top] = 4
                else:
                    e = cursor[top] + 1 if cursor[top] >= 0 else row_first_edge[v]
                    while e < row_first_edge[v + 1]:
                        w = m + edge_block[e]
                        if (
                            e != row_edge[v]
                            and visit[w] != stamp
                            and dead[w] != phase
                            and edge_cost[e] + pv - potential[w] <= tie_ms
                        ):
                            nxt = w
                            pred_edge[w] = e
                            pred_block[w] = -1
                            break
                        e += 1
                    cursor[top] = e
                if nxt >= 0:
                    top += 1
                    stack[top] = nxt
                    stage[top] = 0
                    cursor[top] = -1
                    visit[nxt] = stamp
                else:
                    dead[v] = phase
                    top -= 1
            if end < 0:
                break
            _augment(
                m,
                end,
                edge_row,
                edge_block,
                row_edge,
                used,
                down,
                in_head,
                in_next,
                in_prev,
                pred_edge,
                pred_block,
            )
            sent += 1
    return sent


@numba.njit(cache=True)
def chain_assignment_kernel(
    latency_by_type_ms: np.ndarray,
    tail_by_type_ms: np.ndarray,
    column_type: np.ndarray,
    remaining_ms: np.ndarray,
    heterogeneity: np.ndarray,
    waited_ms: np.ndarray,
    qos_ms: float,
    safety: float,
) -> tuple[np.ndarray, np.ndarray]:
    """A min-cost assignment of the matrix :func:`matching.cost.costs_kernel` builds from the
    same arguments, as (rows, columns) with rows increasing (see the module docstring).

    Columns with the same type and the same h share a chain. No validation: the caller's inputs
    are trusted (finite, latencies and remaining times >= 0, h > 0).

    Three queries, three instances of one type (busy 50 ms, idle, idle), QoS 100 ms: query 2
    (60 ms) fits only on an idle instance and takes the first; queries 0 and 1 (10 ms) fit
    anywhere, and the first in the queue takes the other idle instance.

    >>> rows, cols = chain_assignment_kernel(
    ...     np.array([[10.0], [10.0], [60.0]]), np.array([[10.0], [10.0], [60.0]]),
    ...     np.zeros(3, dtype=np.int64), np.array([50.0, 0.0, 0.0]), np.ones(3), np.zeros(3),
    ...     100.0, 0.98,
    ... )
    >>> rows.tolist(), cols.tolist()
    ([0, 1, 2], [2, 0, 1])
    """
    m = waited_ms.size
    n = column_type.size
    k = min(m, n)
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    # The penalties, bit for bit those of costs_kernel: h (r + l) grows with l, so a column's
    # largest usage is at the largest latency of its type.
    latency_max = np.zeros(latency_by_type_ms.shape[1])
    for i in range(m):
        for f in range(latency_max.size):
            latency_max[f] = max(latency_max[f], latency_by_type_ms[i, f])
    max_usage = 0.0
    for j in range(n):
        max_usage = max(
            max_usage, heterogeneity[j] * (remaining_ms[j] + latency_max[column_type[j]])
        )
    margin_penalty = k * max_usage + PENALTY_SLACK_MS
    miss_penalty = k * (max_usage + margin_penalty) + PENALTY_SLACK_MS
    margin_ms = qos_ms - safety * qos_ms

    (
        columns,
        chain_type,
        chain_h,
        chain_first_block,
        block_remaining,
        block_start,
        block_size,
        chain_blocks,
    ) = _chains(column_type, heterogeneity, remaining_ms)
    n_chains = chain_type.size
    n_blocks = block_size.size
    block_chain = np.empty(n_blocks, dtype=np.int64)
    for c in range(n_chains):
        block_chain[chain_first_block[c] : chain_first_block[c + 1]] = c
    # A block's cost per unit, h r. When every column is used (m >= n) these add up to the same
    # total whatever the assignment, so they are left out: the same optimum, shorter searches.
    sink_cost = np.zeros(n_blocks)
    if m < n:
        for b in range(n_blocks):
            sink_cost[b] = chain_h[block_chain[b]] * block_remaining[b]

    # Edges: query i's prefixes on each chain, where it fits, where it meets QoS, all blocks (an
    # empty or repeated prefix adds no edge).
    edge_row = np.empty(3 * m * n_chains, dtype=np.int64)
    edge_block = np.empty(3 * m * n_chains, dtype=np.int64)
    edge_cost = np.empty(3 * m * n_chains)
    row_first_edge = np.empty(m + 1, dtype=np.int64)
    n_edges = 0
    for i in range(m):
        row_first_edge[i] = n_edges
        budget = max(qos_ms - waited_ms[i], 0.0)
        for c in range(n_chains):
            usage = chain_h[c] * latency_by_type_ms[i, chain_type[c]]
            tail = tail_by_type_ms[i, chain_type[c]]
            first = chain_first_block[c]
            count = chain_blocks[c]
            fits = _blocks_below(1, first, count, block_remaining, budget, tail, margin_ms)
            meets = _blocks_below(2, first, count, block_remaining, budget, tail, margin_ms)
            previous = 0
            for end, penalty in ((fits, 0.0), (meets, margin_penalty), (count, miss_penalty)):
                if end > previous:
                    edge_row[n_edges] = i
                    edge_block[n_edges] = first + end - 1
                    edge_cost[n_edges] = usage + penalty
                    n_edges += 1
                    previous = end
    row_first_edge[m] = n_edges
    edge_row = edge_row[:n_edges]
    edge_block = edge_block[:n_edges]
    edge_cost = edge_cost[:n_edges]

    # Each block's entering edges by cost, then query: its cheapest unassigned entry is a
    # pointer that only moves forward (a query once assigned stays assigned).
    entry_start = np.zeros(n_blocks + 1, dtype=np.int64)
    for e in range(n_edges):
        entry_start[edge_block[e] + 1] += 1
    entry_start = np.cumsum(entry_start)
    fill = entry_start[:n_blocks].copy()
    entries = np.empty(n_edges, dtype=np.int64)
    for e in range(n_edges):
        entries[fill[edge_block[e]]] = e
        fill[edge_block[e]] += 1
    for b in range(n_blocks):
        segment = entries[entry_start[b] : entry_start[b + 1]].copy()
        order = np.argsort(edge_cost[segment], kind="mergesort")
        entries[entry_start[b] : entry_start[b + 1]] = segment[order]
    pointer = entry_start[:n_blocks].copy()

    # Successive shortest paths, several per search where they tie. Nodes: queries 0..m-1,
    # blocks m..m+n_blocks-1, the sink.
    n_nodes = m + n_blocks + 1
    potential = np.zeros(n_nodes)
    row_edge = np.full(m, -1, dtype=np.int64)  # the edge a query uses (-1: unassigned)
    used = np.zeros(n_blocks, dtype=np.int64)  # units into the sink, per block
    down = np.zeros(n_blocks, dtype=np.int64)  # flow on block b -> block b - 1
    in_head = np.full(n_blocks, -1, dtype=np.int64)  # the used edges entering each block
    in_next = np.full(n_edges, -1, dtype=np.int64)
    in_prev = np.full(n_edges, -1, dtype=np.int64)
    pred_edge = np.full(n_nodes, -1, dtype=np.int64)
    pred_block = np.full(n_nodes, -1, dtype=np.int64)
    dist = np.empty(n_nodes)
    done = np.zeros(n_nodes, dtype=np.bool_)
    heap_keys = np.empty(4 * n_blocks + 2 * n_edges + m + 8)
    heap_nodes = np.empty(heap_keys.size, dtype=np.int64)
    visit = np.zeros(n_nodes, dtype=np.int64)
    dead = np.zeros(n_nodes, dtype=np.int64)
    stack = np.empty(n_nodes, dtype=np.int64)
    stage = np.empty(n_nodes, dtype=np.int64)
    cursor = np.empty(n_nodes, dtype=np.int64)
    attempts = np.zeros(1, dtype=np.int64)
    # Paths whose costs differ by less than this are taken as equally short: a few ulps of the
    # largest total the costs reach, so that rounding does not split exact ties.
    tie_ms = 64.0 * np.finfo(np.float64).eps * k * (miss_penalty + max_usage)
    flow = 0
    phase = 0
    while flow < k:
        if not _shortest_path(
            m,
            block_chain,
            chain_first_block,
            block_size,
            sink_cost,
            edge_row,
            edge_block,
            edge_cost,
            row_first_edge,
            entries,
            entry_start,
            pointer,
            potential,
            row_edge,
            used,
            down,
            in_head,
            in_next,
            pred_edge,
            pred_block,
            dist,
            done,
            heap_keys,
            heap_nodes,
        ):
            break  # cannot happen: every query has an edge to every chain
        _augment(
            m,
            pred_block[m + n_blocks],
            edge_row,
            edge_block,
            row_edge,
            used,
            down,
            in_head,
            in_next,
            in_prev,
            pred_edge,
            pred_block,
        )
        flow += 1
        phase += 1
        flow += _tied_paths(
            m,
            k - flow,
            tie_ms,
            phase,
            block_chain,
            chain_first_block,
            block_size,
            sink_cost,
            edge_row,
            edge_block,
            edge_cost,
            row_first_edge,
            entries,
            entry_start,
            pointer,
            potential,
            row_edge,
            used,
            down,
            in_head,
            in_next,
            in_prev,
            pred_edge,
            pred_block,
            visit,
            dead,
            stack,
            stage,
            cursor,
            attempts,
        )

    # Place each chain's queries, by the last block they may use and then queue order, onto its
    # used columns in order of r and then index.
    column_of_row = np.full(m, -1, dtype=np.int64)
    for c in range(n_chains):
        keys = np.empty(m, dtype=np.int64)
        placed = 0
        for i in range(m):
            e = row_edge[i]
            if e >= 0 and block_chain[edge_block[e]] == c:
                keys[placed] = edge_block[e] * m + i
                placed += 1
        keys = np.sort(keys[:placed])
        q = 0
        for b in range(chain_first_block[c], chain_first_block[c + 1]):
            for s in range(used[b]):
                column_of_row[keys[q] % m] = columns[block_start[b] + s]
                q += 1
    rows = np.flatnonzero(column_of_row >= 0)
    return rows.astype(np.int64), column_of_row[rows]
