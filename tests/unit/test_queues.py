"""The central queue that the simulator's event engine and the live dispatcher share
(:mod:`matching.queues`): by hand, and against a plain list under generated operations."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import matching.queues
from matching.errors import InvalidDispatchError
from matching.policy import QueuedQuery
from matching.queues import CentralQueue


def _query(query_id: int, batch_size: int = 1) -> QueuedQuery:
    return QueuedQuery(query_id, batch_size, float(query_id), float(query_id))


def _ids(queue: CentralQueue) -> list[int]:
    return [item.query_id for item in queue]


def test_doctests() -> None:
    failures, _ = doctest.testmod(matching.queues, raise_on_error=False)
    assert failures == 0


def test_reads_skip_what_was_taken_from_the_middle() -> None:
    queue = CentralQueue(_query(q) for q in range(6))
    assert [item.query_id for item in queue.take_batch((4, 1))] == [4, 1]
    assert _ids(queue) == [0, 2, 3, 5] and len(queue) == 4
    assert [item.query_id for item in reversed(queue)] == [5, 3, 2, 0]
    assert queue[0].query_id == 0 and queue[-1].query_id == 5 and queue[2].query_id == 3
    assert [item.query_id for item in queue[1:3]] == [2, 3]
    assert _query(1) not in queue and _query(2) in queue
    assert queue.index(_query(3)) == 2
    with pytest.raises(IndexError):
        queue[4]


def test_taking_the_head_drops_the_tombstones_behind_it() -> None:
    queue = CentralQueue(_query(q) for q in range(4))
    assert queue.take(1) is not None and queue.take(2) is not None
    assert queue.take(0) is not None
    assert _ids(queue) == [3] and queue[0].query_id == 3
    assert queue.take(3) is not None
    assert not queue and _ids(queue) == [] and list(reversed(queue)) == []


def test_a_dispatch_of_queries_not_queued_removes_nothing() -> None:
    queue = CentralQueue(_query(q) for q in range(3))
    with pytest.raises(InvalidDispatchError):
        queue.take_batch((1, 7))
    with pytest.raises(InvalidDispatchError):
        queue.take_batch((2, 2))
    assert _ids(queue) == [0, 1, 2]
    assert queue.take(7) is None


def test_an_id_is_queued_once() -> None:
    queue = CentralQueue([_query(1)])
    with pytest.raises(ValueError, match="queued already"):
        queue.append(_query(1))
    with pytest.raises(ValueError, match="queued already"):
        queue.push_front([_query(2), _query(2)])
    assert _ids(queue) == [1]


def test_a_query_taken_from_the_middle_can_come_back_to_the_front() -> None:
    # The live dispatcher's failed batch: its queries go back to the head with their ids, while
    # the entries they left behind are still tombstones further down.
    queue = CentralQueue(_query(q) for q in range(4))
    taken = queue.take_batch((2,))
    queue.push_front(taken)
    assert _ids(queue) == [2, 0, 1, 3] and len(queue) == 4
    assert queue.take(0) is not None and queue.take(2) is not None
    assert _ids(queue) == [1, 3] and queue[1].query_id == 3


def test_many_removals_from_the_middle_keep_the_deque_small() -> None:
    queue = CentralQueue(_query(q) for q in range(10_000))
    for q in range(1, 10_000, 2):
        assert queue.take(q) is not None
    for q in range(2, 10_000, 2):
        assert queue.take(q) is not None
    assert _ids(queue) == [0] and sum(1 for _ in reversed(queue)) == 1


def test_reading_the_head_drops_the_tombstones_it_passes() -> None:
    # Kairos' pattern: the head waits for a better instance while the queries behind it are
    # dispatched; each round reads the head of the queue by a slice.
    queue = CentralQueue(_query(q) for q in range(1000))
    for q in range(1, 500):
        assert queue.take(q) is not None
    assert [item.query_id for item in queue[:3]] == [0, 500, 501]
    assert len(queue._items) == len(queue) == 501  # the tombstones it passed are gone
    assert [item.query_id for item in queue[:0]] == [] and len(queue) == 501
    # Taken from behind the head, then read: the deque holds only the live queries it passed.
    assert queue.take(500) is not None and queue.take(502) is not None
    assert [item.query_id for item in queue[:2]] == [0, 501]
    assert [item.query_id for item in queue[:3]] == [0, 501, 503]
    assert _ids(queue) == [0, *range(501, 502), *range(503, 1000)]


# --- against a plain list ----------------------------------------------------------------------

_KINDS = ("append", "append_again", "push_front", "take", "take_batch", "pop", "index", "head")
# An operation's kind and two raw draws that the test turns into its arguments.
_operation = st.tuples(st.sampled_from(_KINDS), st.integers(0, 1000), st.integers(-40, 40))


@settings(max_examples=300, deadline=None)
@given(st.lists(_operation, min_size=20, max_size=100))
def test_the_queue_behaves_as_a_list_in_queue_order(
    operations: list[tuple[str, int, int]],
) -> None:
    """The reference is a list in queue order: ``append`` adds at the end, ``push_front`` at the
    start, a take removes wherever the query is; every read of the queue must match it."""
    queue = CentralQueue()
    reference: list[QueuedQuery] = []
    out: list[QueuedQuery] = []  # taken, and free to come back (same id, same query)
    next_id = 0
    for kind, a, b in operations:
        if kind == "append":
            item = _query(next_id, 1 + a % 4)
            next_id += 1
            queue.append(item)
            reference.append(item)
        elif kind == "append_again" and out:
            item = out.pop(a % len(out))
            queue.append(item)
            reference.append(item)
        elif kind == "push_front" and out:
            count = 1 + a % min(len(out), 3)
            back = [out.pop((a + i) % len(out)) for i in range(count)]
            queue.push_front(back)
            reference[:0] = back
        elif kind == "take":
            # A queued query (anywhere in the queue), or any id, queued or not.
            query_id = reference[a % len(reference)].query_id if b >= 0 and reference else a
            expected = next((item for item in reference if item.query_id == query_id), None)
            assert queue.take(query_id) is expected
            if expected is not None:
                reference.remove(expected)
                out.append(expected)
        elif kind == "take_batch" and reference:
            count = 1 + a % min(len(reference), 4)
            start = abs(b) % len(reference)
            chosen = [reference[(start + 3 * i) % len(reference)] for i in range(count)]
            ids = tuple(dict.fromkeys(item.query_id for item in chosen))
            if b < 0:  # a dispatch naming a query that is not queued: nothing moves
                with pytest.raises(InvalidDispatchError):
                    queue.take_batch((*ids, next_id))
            else:
                taken = queue.take_batch(ids)
                assert [item.query_id for item in taken] == list(ids)
                for item in taken:
                    reference.remove(item)
                    out.append(item)
        elif kind == "pop" and reference:
            head = queue[0]
            assert head is reference[0]
            assert queue.take(head.query_id) is head
            out.append(reference.pop(0))
        elif kind == "index":
            # Anywhere in the queue (from the head, or from the tail when b < 0), or b itself.
            if reference and abs(b) <= 30:
                index = a % len(reference) - (len(reference) if b < 0 else 0)
            else:
                index = b
            if -len(reference) <= index < len(reference):
                assert queue[index] is reference[index]
            else:
                with pytest.raises(IndexError):
                    queue[index]
        elif kind == "head":
            assert queue[: a % 9] == reference[: a % 9]
        assert list(queue) == reference
        assert list(reversed(queue)) == reference[::-1]
        assert len(queue) == len(reference) and bool(queue) == bool(reference)
        assert list(queue[a % 7 : b]) == reference[a % 7 : b]
        assert all(item in queue for item in reference)
        assert not any(item in queue for item in out)
