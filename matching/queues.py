"""A stage's central queue: queries in queue order, removal from anywhere, lazy tombstones.

Both engines that run a dispatch policy keep one per stage: the simulator's event engine
(:mod:`estimator.simulator`) and the live dispatcher (:mod:`controlplane.serving.dispatcher`). A
policy reads it as a ``Sequence[QueuedQuery]`` (:class:`matching.policy.DispatchPolicy`) and may
dispatch queries from anywhere in it (Kairos, DRS, Clockwork), so a removal must not cost the
length of the queue: rebuilding a deque for each such removal made overloaded runs quadratic.

Representation: a deque of entries in queue order and a dict id -> query of the live ones. Taking
the head pops it; taking any other query drops it from the dict and leaves its entry behind as a
*tombstone* (its id in a set). Reads skip tombstones; they are dropped once they reach the head (so
the head entry is always live), and the deque is compacted (rebuilt without them) when an indexed
read other than the head finds any, when they outnumber the live entries by more than
:data:`_SLACK`, or when a query taken from the middle is queued again (the failed batch of the live
dispatcher).

Costs, for n live queries and t tombstones (t <= n + 64): ``append``, ``push_front`` (per query),
``take`` and ``len`` O(1) amortised; iteration O(n + t); ``queue[0]`` O(1); ``queue[i]`` O(1)
without tombstones, else one O(n + t) compaction first; ``queue[:k]`` O(k) plus the tombstones it
passes, which it drops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import overload

from matching.errors import InvalidDispatchError
from matching.policy import QueuedQuery

__all__ = ["CentralQueue"]

# Tombstones beyond the live entries that may stay behind before a take compacts the deque (a
# small queue is not rebuilt for every other removal). Without a bound, tombstones pile up behind a
# query that stays at the head (Kairos leaves it for a better instance) and every round's read
# walks them: an overloaded Kairos run (rm2, 150 q/s on 1 + 13 instances) ran 5x slower.
_SLACK = 64


class CentralQueue(Sequence[QueuedQuery]):
    """A stage's central queue of :class:`~matching.policy.QueuedQuery`, in queue order.

    New queries join at the tail (``append``); a failed batch goes back to the head
    (``push_front``: its queries are the oldest there); a policy's dispatch is taken out from
    anywhere (``take_batch``, all or nothing), and so is a query whose request ended (``take``).
    Query ids are unique among the queued queries.

    >>> queue = CentralQueue()
    >>> for q in range(5):
    ...     queue.append(QueuedQuery(q, 1, float(q), float(q)))
    >>> queue.take(2).query_id, queue.take(2)
    (2, None)
    >>> [item.query_id for item in queue.take_batch((3, 0))]
    [3, 0]
    >>> [item.query_id for item in queue], len(queue), queue[1].query_id
    ([1, 4], 2, 4)
    >>> queue.push_front([QueuedQuery(3, 1, 3.0, 3.0)])
    >>> [item.query_id for item in reversed(queue)]
    [4, 1, 3]
    """

    __slots__ = ("_by_id", "_items", "_removed")

    def __init__(self, items: Iterable[QueuedQuery] = ()) -> None:
        self._items: deque[QueuedQuery] = deque()
        self._by_id: dict[int, QueuedQuery] = {}
        self._removed: set[int] = set()
        for item in items:
            self.append(item)

    # --- writes ---------------------------------------------------------------------------------

    def append(self, item: QueuedQuery) -> None:
        """Queue ``item`` at the tail; raises ValueError when its id is queued already."""
        query_id = item.query_id
        by_id = self._by_id
        if query_id in by_id:
            raise ValueError(f"query {query_id} is queued already")
        if self._removed and query_id in self._removed:
            self._compact()  # its old entry must not be mistaken for the new one
        self._items.append(item)
        by_id[query_id] = item

    def push_front(self, items: Sequence[QueuedQuery]) -> None:
        """Queue ``items`` at the head, in that order (the head becomes ``items[0]``)."""
        by_id = self._by_id
        ids = [item.query_id for item in items]
        if len(set(ids)) != len(ids) or any(q in by_id for q in ids):
            raise ValueError(f"queries queued already: {ids}")
        if self._removed and not self._removed.isdisjoint(ids):
            self._compact()
        for item in reversed(items):
            self._items.appendleft(item)
            by_id[item.query_id] = item

    def take(self, query_id: int) -> QueuedQuery | None:
        """Remove the query ``query_id`` and return it (None when it is not queued)."""
        item = self._by_id.pop(query_id, None)
        if item is None:
            return None
        self._drop(query_id)
        return item

    def take_batch(self, query_ids: Sequence[int]) -> list[QueuedQuery]:
        """Remove the queries ``query_ids`` (a policy's dispatch) and return them in that order;
        raises :class:`~matching.errors.InvalidDispatchError`, removing nothing, when one is not
        queued or named twice."""
        by_id = self._by_id
        if len(set(query_ids)) != len(query_ids) or any(q not in by_id for q in query_ids):
            raise InvalidDispatchError(f"dispatch of queries that are not queued: {query_ids}")
        # _drop inlined: this runs once per dispatch in the simulator's event engine.
        items = self._items
        removed = self._removed
        taken = []
        for q in query_ids:
            taken.append(by_id.pop(q))
            if items[0].query_id == q:
                items.popleft()
            else:
                removed.add(q)
        if removed:
            while items and items[0].query_id in removed:
                removed.discard(items.popleft().query_id)
            if len(removed) > len(by_id) + _SLACK:
                self._compact()
        return taken

    def _drop(self, query_id: int) -> None:
        """The entry of ``query_id`` (no longer in ``_by_id``) leaves the deque, now when it is
        the head, else as a tombstone."""
        items = self._items
        removed = self._removed
        if items[0].query_id == query_id:
            items.popleft()
        else:
            removed.add(query_id)
        if removed:
            while items and items[0].query_id in removed:
                removed.discard(items.popleft().query_id)
            if len(removed) > len(self._by_id) + _SLACK:
                self._compact()

    def _compact(self) -> None:
        # New objects rather than mutated ones: an iterator already handed out (a policy that
        # iterates and indexes in one round) keeps reading what it started on.
        removed = self._removed
        self._items = deque(item for item in self._items if item.query_id not in removed)
        self._removed = set()

    # --- reads ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[QueuedQuery]:
        if not self._removed:
            return iter(self._items)
        removed = self._removed
        return (item for item in self._items if item.query_id not in removed)

    def __reversed__(self) -> Iterator[QueuedQuery]:
        if not self._removed:
            return reversed(self._items)
        removed = self._removed
        return (item for item in reversed(self._items) if item.query_id not in removed)

    @overload
    def __getitem__(self, index: int) -> QueuedQuery: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[QueuedQuery]: ...
    def __getitem__(self, index: int | slice) -> QueuedQuery | Sequence[QueuedQuery]:
        if isinstance(index, slice):
            stop = index.stop
            head = index.start in (None, 0) and index.step in (None, 1)
            if head and stop is not None and stop >= 0:
                return self._head(stop)
            return list(self)[index]
        n = len(self._by_id)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(index)
        if self._removed and index:  # the head entry is always live
            self._compact()
        return self._items[index]

    def _head(self, count: int) -> list[QueuedQuery]:
        """``queue[:count]``: the first ``count`` live queries. The tombstones met on the way
        leave the deque for good, so that a policy that reads the head of the queue each round
        (Kairos: twice as many queries as instances) pays for what it reads, not for every query
        taken from behind a head that stays (an overloaded Kairos run was quadratic in its
        queries: one of 60,000 queries spent 60 of its 75 s skipping them)."""
        items = self._items
        removed = self._removed
        if not removed:
            return list(islice(items, count))
        kept: list[QueuedQuery] = []
        popleft = items.popleft
        while items and len(kept) < count:
            item = popleft()
            if item.query_id in removed:
                removed.discard(item.query_id)
            else:
                kept.append(item)
        items.extendleft(reversed(kept))
        return kept

    def __contains__(self, item: object) -> bool:
        return isinstance(item, QueuedQuery) and self._by_id.get(item.query_id) == item
