"""``heteroplane serve``'s server signals its loops child as soon as a signal stops it, so that
the child's running jobs finish while the requests in flight drain (not one after the other)."""

from __future__ import annotations

import signal

import uvicorn

from controlplane.cli.serve import _Server


class _Loops:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def begin_stop(self, signum: int) -> None:
        self.signals.append(signum)


async def _app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError


def test_the_stopping_signal_reaches_the_loops_child_at_once() -> None:
    loops = _Loops()
    server = _Server(uvicorn.Config(_app), loops)  # type: ignore[arg-type]
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    assert loops.signals == [signal.SIGTERM]


def test_without_a_loops_child_the_server_stops_as_uvicorn_does() -> None:
    server = _Server(uvicorn.Config(_app), None)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit


def test_the_loops_child_is_not_forced_out_by_a_second_signal() -> None:
    """A `pkill -INT` reaches the serving process and its loops child at once, and the serving
    process then signals the child too: uvicorn took the second signal for a second Ctrl-C and
    forced the exit, its lifespan cut with a CancelledError traceback (a tester's). The child
    (supervised) keeps stopping gracefully; a server of its own still forces on a second
    Ctrl-C."""
    stops: list[str] = []
    child = _Server(
        uvicorn.Config(_app), None, supervised=True, on_stop=lambda: stops.append("stop")
    )
    child.handle_exit(signal.SIGTERM, None)
    child.handle_exit(signal.SIGINT, None)
    assert child.should_exit and not child.force_exit
    assert stops == ["stop"]  # told once, at the first (its feed's failures are no outage)
    alone = _Server(uvicorn.Config(_app), None)
    alone.handle_exit(signal.SIGINT, None)
    alone.handle_exit(signal.SIGINT, None)
    assert alone.force_exit


def test_a_second_signal_inside_the_first_ones_stop_does_not_hang_it() -> None:
    """``pkill -f 'demo --port P'`` reached ``timeout`` and the demo both, and ``timeout``
    forwarded its SIGTERM: the second signal ran the handler on the main thread while the
    first still held the stop event's lock, and the demo hung in its stop for good. Here the
    first call holds that lock (as the interrupted handler did) while a second comes: it must
    return without taking it."""
    import threading

    from controlplane.cli.loops_process import LoopsProcess

    loops = LoopsProcess.__new__(LoopsProcess)  # no child: the stop's own locking is tested
    loops._stopping = threading.Event()
    loops._mutex = threading.Lock()
    loops._process = None
    loops._signalled = False
    loops._begun = False
    loops.begin_stop(signal.SIGTERM)
    with loops._stopping._cond, loops._mutex:  # the first handler, interrupted inside them
        second = threading.Thread(target=loops.begin_stop, args=(signal.SIGTERM,), daemon=True)
        second.start()
        second.join(timeout=30.0)
        assert not second.is_alive()  # it returned; before, it waited on the locks forever
    assert loops._stopping.is_set() and loops._signalled
