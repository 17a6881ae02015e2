"""Which running workers have stopped answering (:mod:`controlplane.loops.liveness`): the
verdicts over time with a stand-in probe, and the HTTP probe against real sockets."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.loops.liveness import Liveness, http_probe
from provisioners.base import ProvisionedInstance


def instance(
    pid: str, state: str = "running", address: str | None = "127.0.0.1:1"
) -> ProvisionedInstance:
    return ProvisionedInstance(pid, "small", state, {}, address=address)  # type: ignore[arg-type]


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


def test_a_worker_that_answered_is_unresponsive_after_a_minute_of_silence() -> None:
    answers = Answers()
    liveness = Liveness(answers, after_s=60.0, never_after_s=600.0)
    workers = [instance("a"), instance("b")]
    assert liveness.check(workers, 0.0) == {}
    answers.silent.add("a")
    assert liveness.check(workers, 30.0) == {}
    assert liveness.check(workers, 59.0) == {}
    found = liveness.check(workers, 61.0)
    assert list(found) == ["a"] and "61 s" in found["a"]
    # One answer is enough to clear it.
    answers.silent.clear()
    assert liveness.check(workers, 62.0) == {}
    answers.silent.add("a")
    assert liveness.check(workers, 100.0) == {}


def test_a_worker_that_never_answered_gets_the_straggler_timeout() -> None:
    answers = Answers()
    answers.silent.add("booting")
    liveness = Liveness(answers, after_s=60.0, never_after_s=600.0)
    workers = [instance("booting")]
    assert liveness.check(workers, 1000.0) == {}  # first seen running now
    assert liveness.check(workers, 1500.0) == {}  # an agent may still be loading its model
    found = liveness.check(workers, 1600.0)
    assert "never answered" in found["booting"] and "600 s" in found["booting"]


def test_only_running_instances_are_asked_and_the_gone_are_forgotten() -> None:
    answers = Answers()
    answers.silent.add("a")
    liveness = Liveness(answers, after_s=10.0, never_after_s=10.0)
    liveness.check([instance("a"), instance("p", "pending"), instance("t", "terminated")], 0.0)
    assert answers.asked == ["a"]
    # Not listed as running for a tick: seen again, its time starts afresh.
    liveness.check([instance("a", "stopping")], 5.0)
    assert liveness.check([instance("a")], 12.0) == {}
    assert list(liveness.check([instance("a")], 22.0)) == ["a"]


def test_a_probe_that_raises_is_no_answer_and_many_are_asked_side_by_side() -> None:
    answers = Answers()
    liveness = Liveness(answers, after_s=5.0, never_after_s=5.0)
    workers = [instance("raises")] + [instance(f"w{i}") for i in range(40)]
    assert liveness.check(workers, 0.0) == {}
    assert list(liveness.check(workers, 6.0)) == ["raises"]
    assert sorted(set(answers.asked)) == sorted(w.provider_id for w in workers)


def test_the_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        Liveness(Answers(), after_s=0.0, never_after_s=600.0)


# --- the HTTP probe ---------------------------------------------------------------------------


class _Agent(BaseHTTPRequestHandler):
    """``/health`` as a worker agent answers it, in the shape the test's path asks for."""

    def do_GET(self) -> None:
        kind = self.server.kind  # type: ignore[attr-defined]
        status, body = {
            "ok": (200, json.dumps({"status": "ok"})),
            "loading": (503, json.dumps({"status": "loading"})),
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
    [("ok", True), ("loading", True), ("failed", False), ("html", False), ("list", False)],
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
