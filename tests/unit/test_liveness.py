"""Which running workers have stopped answering (:mod:`controlplane.loops.liveness`): the
verdicts over time with a stand-in probe, and the HTTP probe against real sockets."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.loops.liveness import Liveness, http_probe
from controlplane.service.build import worker_liveness
from controlplane.settings import Settings
from provisioners.base import ProvisionedInstance
from provisioners.worker.oip import WORKER_PROTOCOL

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def instance(
    pid: str,
    state: str = "running",
    address: str | None = "127.0.0.1:1",
    launched_s: float | None = -3600.0,
) -> ProvisionedInstance:
    launched = None if launched_s is None else at(launched_s)
    return ProvisionedInstance(pid, "small", state, {}, address=address, launched_at=launched)  # type: ignore[arg-type]


class Answers:
    """A probe whose answer per provider id the test sets (True unless said otherwise)."""

    def __init__(self) -> None:
        self.silent: set[str] = set()
        self.asked: list[str] = []

    def __call__(self, worker: ProvisionedInstance) -> bool:
        self.asked.append(worker.provider_id)
        if worker.provider_id == "raises":
            raise RuntimeError("the probe broke")
        return worker.provider_id not in self.silent


def three() -> list[ProvisionedInstance]:
    """Workers a, b and c, long running (one silent of three is no mass silence)."""
    return [instance("a"), instance("b"), instance("c")]


def waiting(answers: Answers, **limits: float) -> Liveness:
    """A liveness that probes as it checks (the reconciler's probes in the background)."""
    return Liveness(answers, background=False, **{"never_after_s": 600.0, **limits})


def every_5_s(
    liveness: Liveness, workers: list[ProvisionedInstance], start: float, end: float
) -> dict[str, str]:
    """Checks every 5 s (the reconciler's period) from ``start`` to ``end``; the last verdicts."""
    found: dict[str, str] = {}
    t = start
    while t <= end:
        found = liveness.check(workers, at(t))
        t += 5.0
    return found


def test_a_worker_that_answered_is_unresponsive_after_a_minute_of_silence() -> None:
    answers = Answers()
    liveness = waiting(answers, after_s=60.0)
    workers = three()
    assert every_5_s(liveness, workers, 0.0, 20.0) == {}
    answers.silent.add("a")
    assert every_5_s(liveness, workers, 25.0, 80.0) == {}  # silent for 55 s
    found = liveness.check(workers, at(85.0))
    assert list(found) == ["a"] and "60 s (13 probes)" in found["a"]
    assert liveness.silent() == {"a"}
    # One answer is enough to clear it.
    answers.silent.clear()
    assert liveness.check(workers, at(90.0)) == {} and liveness.silent() == set()
    answers.silent.add("a")
    assert every_5_s(liveness, workers, 95.0, 150.0) == {}


def test_one_missed_probe_is_never_a_death_whatever_the_setting() -> None:
    answers = Answers()
    liveness = waiting(answers, after_s=0.5)
    workers = three()
    liveness.check(workers, at(0.0))
    answers.silent.add("a")
    assert liveness.check(workers, at(5.0)) == {}
    assert liveness.check(workers, at(10.0)) == {}
    assert list(liveness.check(workers, at(15.0))) == ["a"]  # the third in a row


def test_a_gap_in_the_probes_starts_the_silence_afresh() -> None:
    # A replica that lost the lead (or a provider that could not be listed) asked nobody
    # meanwhile: one failed probe after the gap says nothing of the time in between.
    answers = Answers()
    liveness = waiting(answers, after_s=60.0)
    workers = three()
    liveness.check(workers, at(0.0))
    answers.silent.add("a")
    assert every_5_s(liveness, workers, 600.0, 650.0) == {}
    assert list(liveness.check(workers, at(660.0))) == ["a"]


def test_a_booting_worker_gets_the_straggler_timeout_from_its_launch() -> None:
    answers = Answers()
    answers.silent.add("new")
    liveness = waiting(answers, after_s=60.0, never_after_s=600.0)
    workers = [instance("new", launched_s=0.0), instance("b"), instance("c")]
    assert every_5_s(liveness, workers, 0.0, 595.0) == {}  # an agent may still load its model
    found = liveness.check(workers, at(600.0))
    assert "nor once since its launch 600 s ago" in found["new"]
    # Launched long ago and never seen answering (this process is new): a minute is enough.
    answers.silent = {"old"}
    liveness = waiting(answers, after_s=60.0, never_after_s=600.0)
    workers = [instance("old", launched_s=-7200.0), instance("b"), instance("c")]
    assert every_5_s(liveness, workers, 0.0, 55.0) == {}
    assert list(liveness.check(workers, at(60.0))) == ["old"]
    # No launch time: the straggler timeout from when it was first seen.
    answers.silent = {"unknown"}
    liveness = waiting(answers, after_s=60.0, never_after_s=600.0)
    workers = [instance("unknown", launched_s=None), instance("b"), instance("c")]
    assert every_5_s(liveness, workers, 0.0, 595.0) == {}
    assert list(liveness.check(workers, at(600.0))) == ["unknown"]


def test_most_workers_silent_at_once_replaces_none() -> None:
    answers = Answers()
    liveness = waiting(answers, after_s=10.0)
    workers = [instance(p) for p in "abcd"]
    liveness.check(workers, at(0.0))
    answers.silent = {"a", "b", "c"}
    assert every_5_s(liveness, workers, 5.0, 60.0) == {}
    assert liveness.silent() == {"a", "b", "c"}
    answers.silent = {"a"}  # the others are back: the one still silent is found
    assert list(liveness.check(workers, at(65.0))) == ["a"]
    # Of one worker alone, its silence is its own.
    answers.silent = {"solo"}
    liveness = waiting(answers, after_s=10.0)
    solo = [instance("solo")]
    assert list(every_5_s(liveness, solo, 0.0, 20.0)) == ["solo"]


def test_only_running_instances_are_asked_and_the_gone_are_forgotten() -> None:
    answers = Answers()
    answers.silent.add("a")
    liveness = waiting(answers, after_s=10.0, never_after_s=10.0)
    others = [instance("b"), instance("c")]
    listed = [instance("a"), instance("p", "pending"), instance("t", "terminated"), *others]
    liveness.check(listed, at(0.0))
    assert sorted(answers.asked) == ["a", "b", "c"]
    # Not listed as running for a tick: seen again, its silence starts afresh.
    liveness.check([instance("a", "stopping"), *others], at(5.0))
    assert every_5_s(liveness, [instance("a"), *others], 10.0, 15.0) == {}
    assert list(every_5_s(liveness, [instance("a"), *others], 20.0, 20.0)) == ["a"]


def test_a_probe_that_raises_is_no_answer_and_many_are_asked() -> None:
    answers = Answers()
    liveness = waiting(answers, after_s=5.0)
    workers = [instance("raises")] + [instance(f"w{i}") for i in range(40)]
    assert list(every_5_s(liveness, workers, 0.0, 15.0)) == ["raises"]
    assert sorted(set(answers.asked)) == sorted(w.provider_id for w in workers)


def test_in_the_background_a_tick_never_waits_for_its_probes() -> None:
    release = threading.Event()
    asked = threading.Event()

    def slow(worker: ProvisionedInstance) -> bool:
        asked.set()
        release.wait(30.0)
        return worker.provider_id != "hung"

    liveness = Liveness(slow, after_s=10.0, never_after_s=600.0)
    workers = [instance("hung"), instance("b"), instance("c")]
    assert liveness.check(workers, at(0.0)) == {}  # returns with its probes in flight
    assert asked.wait(30.0)
    assert liveness.check(workers, at(5.0)) == {}  # still in flight: not asked twice
    assert liveness.silent() == set()
    release.set()
    assert liveness.settle(30.0)
    for t in (10.0, 15.0, 20.0, 25.0):
        liveness.check(workers, at(t))
        assert liveness.settle(30.0)
    # The rounds started at 0, 10, 15, 20 and 25 s found it silent (one tick behind).
    assert liveness.silent() == {"hung"}
    found = liveness.check(workers, at(30.0))
    assert list(found) == ["hung"] and "30 s (5 probes)" in found["hung"]


def test_the_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        Liveness(Answers(), after_s=0.0, never_after_s=600.0)


# --- the HTTP probe ---------------------------------------------------------------------------


class _Agent(BaseHTTPRequestHandler):
    """``/health`` as a worker agent answers it, in the shape the test's path asks for."""

    def do_GET(self) -> None:
        kind = self.server.kind  # type: ignore[attr-defined]
        status, body = {
            "ok": (200, json.dumps({"status": "ok", "protocol": WORKER_PROTOCOL})),
            "busy": (200, json.dumps({"status": "ok", "busy": True, "busy_s": 42.0})),
            "stuck": (200, json.dumps({"status": "ok", "busy": True, "busy_s": 700.25})),
            "edge": (200, json.dumps({"status": "ok", "busy": True, "busy_s": 600.004})),
            # Past the bound, its caller still waiting (a slow model's long call timeout).
            "waited": (
                200,
                json.dumps(
                    {"status": "ok", "busy": True, "busy_s": 700.25, "busy_timeout_s": 900.0}
                ),
            ),
            # A direct caller's timeout of 10^12 us: waited out for an hour at most.
            "forever": (
                200,
                json.dumps({"status": "ok", "busy": True, "busy_s": 3700.0, "busy_timeout_s": 1e6}),
            ),
            "overdue": (
                200,
                json.dumps(
                    {"status": "ok", "busy": True, "busy_s": 950.0, "busy_timeout_s": 900.0}
                ),
            ),
            "idle": (200, json.dumps({"status": "ok", "busy": False, "busy_s": 0.0})),
            "older": (200, json.dumps({"status": "ok", "protocol": 1})),
            "unsaid": (200, json.dumps({"status": "ok"})),  # an agent of before the field
            "odd": (200, json.dumps({"status": "ok", "protocol": "1"})),
            "loading": (503, json.dumps({"status": "loading"})),
            "stopping": (503, json.dumps({"status": "stopping", "protocol": WORKER_PROTOCOL})),
            "failed": (503, json.dumps({"status": "failed", "error": "no model"})),
            "html": (200, "<html>a proxy page</html>"),
            "list": (200, json.dumps(["ok"])),
        }[kind]
        payload = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def agent() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("kind", "alive"),
    [
        ("ok", True),
        ("stopping", True),
        ("loading", False),
        ("failed", False),
        ("html", False),
        ("list", False),
    ],
)
def test_the_http_probe_reads_the_agents_health(
    agent: ThreadingHTTPServer, kind: str, alive: bool
) -> None:
    agent.kind = kind  # type: ignore[attr-defined]
    port = int(agent.server_address[1])
    probe = http_probe(port, timeout_s=5.0)
    # A local worker's address names its port; an EC2 private IP gets the agent's.
    assert probe(instance("w", address=f"127.0.0.1:{port}")) is alive
    assert probe(instance("w", address="127.0.0.1")) is alive


def test_the_http_probe_says_why_an_older_releases_agent_cannot_serve(
    agent: ThreadingHTTPServer,
) -> None:
    """A worker an older release started, kept across an upgrade and adopted, cannot serve
    what the dispatcher sends (a release of before 2026-11-29 answered every batch of binary
    tensors 400, every query 422 until the app was taken down: a tester's upgrade): an agent
    that says an older protocol is named; one that says none (the agents of before the field,
    most of which read binary tensors) or something else answered, and stays."""
    agent.kind = "older"  # type: ignore[attr-defined]
    port = int(agent.server_address[1])
    probe = http_probe(port, timeout_s=5.0)
    why = probe(instance("w", address=f"127.0.0.1:{port}"))
    assert isinstance(why, str) and f"protocol 1, this control plane sends {WORKER_PROTOCOL}" in why
    for kind in ("unsaid", "odd"):
        agent.kind = kind  # type: ignore[attr-defined]
        assert probe(instance("w", address=f"127.0.0.1:{port}")) is True


def test_the_http_probe_says_a_worker_stuck_on_a_batch_cannot_serve(
    agent: ThreadingHTTPServer,
) -> None:
    """A model stuck on a query while its agent's HTTP server answers: the serving path keeps
    the worker out of matching while the agent says it is busy, so it served nothing, paid for,
    for good. An agent whose oldest batch has run past the bound is named; one busy for less,
    or idle, answered."""
    port = int(agent.server_address[1])
    probe = http_probe(port, timeout_s=5.0, stuck_after_s=600.0)
    agent.kind = "stuck"  # type: ignore[attr-defined]
    why = probe(instance("w", address=f"127.0.0.1:{port}"))
    assert isinstance(why, str), why
    assert "one batch for 700.3 s, over 600 s" in why and why.endswith("replaced"), why
    # Just past the bound, the age said reads past it (whole seconds read "600 s, over 600 s").
    agent.kind = "edge"  # type: ignore[attr-defined]
    why = probe(instance("w", address=f"127.0.0.1:{port}"))
    assert isinstance(why, str) and "one batch for 600.1 s, over 600 s" in why, why
    # A batch its caller still waits for is not stuck, whatever the bound (a bound set under
    # a call's timeout ended a slow query's worker mid-call, and the query, tried again, took
    # out the next); past the caller's timeout it is, said against that timeout.
    for kind in ("busy", "idle", "waited"):
        agent.kind = kind  # type: ignore[attr-defined]
        assert probe(instance("w", address=f"127.0.0.1:{port}")) is True, kind
    agent.kind = "overdue"  # type: ignore[attr-defined]
    overdue = probe(instance("w", address=f"127.0.0.1:{port}"))
    assert isinstance(overdue, str), overdue
    assert "one batch for 950.0 s, over its caller's timeout of 900 s" in overdue, overdue
    agent.kind = "forever"  # type: ignore[attr-defined]
    forever = probe(instance("w", address=f"127.0.0.1:{port}"))
    assert isinstance(forever, str), forever
    assert "for 3700.0 s, over 3600 s, the longest caller's timeout waited out" in forever, forever
    liveness = Liveness(lambda worker: why, background=False, never_after_s=600.0)
    assert liveness.check([instance("a")], at(0.0)) == {"a": why}  # at its first probe


def test_an_older_releases_worker_is_replaced_at_once_even_when_all_are() -> None:
    """Every worker of the app an older release's (all adopted after an upgrade): each is a
    verdict at the first probe, not held back as a mass silence (they answer; none can serve)."""
    older = "its agent reads worker protocol 1 ...; replaced by one of this release"

    def probe(worker: ProvisionedInstance) -> bool | str:
        return older if worker.provider_id != "new" else True

    liveness = Liveness(probe, background=False, never_after_s=600.0)
    found = liveness.check([*three(), instance("new")], at(0.0))
    assert sorted(found) == ["a", "b", "c"]
    assert all(why.startswith(older) and "replaced" in why for why in found.values())
    assert liveness.silent() == set()  # they answered


def _address(bound: socket.socket) -> str:
    host, port = bound.getsockname()
    return f"{host}:{port}"


def test_the_http_probe_gives_up_on_a_worker_that_accepts_and_never_answers() -> None:
    # A listening socket that never accepts: the kernel completes the connection (as for a
    # stopped process), and nothing ever answers.
    with socket.socket() as hung, socket.socket() as closed:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        probe = http_probe(1, timeout_s=0.2)
        assert probe(instance("h", address=_address(hung))) is False
        assert probe(instance("c", address=_address(closed))) is False
        assert probe(instance("n", address=None)) is False


def test_the_services_probe_takes_its_stuck_bound_from_the_settings(
    agent: ThreadingHTTPServer,
) -> None:
    """``worker_stuck_s`` reaches the reconciler's probe: an agent busy for 42 s is stuck at a
    bound of 30 s, not at the default's 600."""
    port = int(agent.server_address[1])
    agent.kind = "busy"  # type: ignore[attr-defined]
    address = f"127.0.0.1:{port}"  # names its port: the default worker port is not asked
    for stuck_s, stuck in ((30.0, True), (600.0, False)):
        liveness = worker_liveness(Settings(provisioner="local", worker_stuck_s=stuck_s))
        assert liveness is not None
        answer = liveness.probe(instance("w", address=address))
        assert isinstance(answer, str) is stuck, answer
