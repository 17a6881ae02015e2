"""The bounds on what one client may hold, against ``heteroplane serve`` on a loopback port
(controlplane.service.protocol, docs/operations.md "Connection limits"): a head that does not
arrive whole in time is answered 408 and closed, a connection that sends nothing is closed, a
body that trickles is answered 408 and closed, and connections without a valid token past the
cap push out the least recently active of them, while ``/healthz`` goes on answering.

Every wait is a blocking read with a deadline (the socket's timeout): the test goes on as soon
as the server closes, and fails if it has not by the deadline.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_serve import Server, create_token

# Far beyond the limits the servers below run with: only a server that never closes hits it.
DEADLINE_S = 30.0


def _server(folder: Path, **settings: str) -> Server:
    data_dir = folder / "data"
    data_dir.mkdir()
    return Server(data_dir, folder / "serve.log", **settings)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with heads due in half a second and bodies at 1,000 bytes/s per half second."""
    running = _server(
        tmp_path_factory.mktemp("quick"),
        http_head_timeout_s="0.5",
        http_body_min_rate_bytes_per_s="1000",
        http_body_rate_window_s="0.5",
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that keeps at most 8 unauthenticated connections (heads due in a minute)."""
    running = _server(
        tmp_path_factory.mktemp("capped"),
        http_unauthenticated_connections_max="8",
        http_head_timeout_s="60",
    )
    try:
        yield running
    finally:
        running.stop()


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; socket.timeout past the deadline."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass  # closed as well (a reset after the answer, if any, was read)
    return answer


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 answer: the head, then a body of its Content-Length.

    A single recv can end between the head and the body, which would leave the body
    to be read as the start of the next answer.
    """
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def status_and_error(answer: bytes) -> tuple[bytes, dict[str, object]]:
    status_line, _, rest = answer.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return status_line, json.loads(body)


def test_a_connection_that_sends_nothing_is_closed(quick: Server) -> None:
    with connect(quick) as sock:
        assert read_until_closed(sock) == b""
    assert httpx.get(f"{quick.url}/healthz").status_code == 200


def test_a_head_that_never_ends_is_a_408(quick: Server) -> None:
    with connect(quick) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        status_line, body = status_and_error(read_until_closed(sock))
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert body["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert httpx.get(f"{quick.url}/healthz").status_code == 200


def test_a_head_on_v2_that_never_ends_is_a_408_in_the_protocol_shape(quick: Server) -> None:
    with connect(quick) as sock:
        sock.sendall(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        status_line, body = status_and_error(read_until_closed(sock))
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert isinstance(body["error"], str) and "head" in body["error"]


def test_a_body_that_trickles_is_a_408(quick: Server) -> None:
    token = create_token(quick.data_dir, "admin", "slow-body")
    with connect(quick) as sock:
        sock.sendall(
            b"POST /v1/apps HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\nContent-Length: 100000\r\n\r\n{"
        )
        status_line, body = status_and_error(read_until_closed(sock))
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert "slower than 1000 bytes/s" in body["error"]["message"]  # type: ignore[index]


def test_a_model_push_that_declares_900_mb_and_sends_10_bytes_is_a_408(quick: Server) -> None:
    """The push route streams its body under its own 1 GiB limit: the rate still applies."""
    token = create_token(quick.data_dir, "operator", "slow-push")
    with connect(quick) as sock:
        sock.sendall(
            b"POST /v1/models/slow?format=onnx HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/octet-stream\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\n"
            b"Content-Length: 900000000\r\n\r\n0123456789"
        )
        status_line, _ = status_and_error(read_until_closed(sock))
    assert status_line == b"HTTP/1.1 408 Request Timeout"


def test_a_prompt_client_is_not_cut_off(quick: Server) -> None:
    """Heads and bodies that arrive at once are served, over a kept-alive connection too."""
    with httpx.Client(base_url=quick.url) as client:
        for _ in range(3):
            assert client.get("/healthz").status_code == 200
        answer = client.post(
            "/v1/apps", content=b"{}", headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 401


def test_unauthenticated_connections_past_the_cap_push_out_the_oldest(capped: Server) -> None:
    token = create_token(capped.data_dir, "viewer", "kept")
    with connect(capped) as kept:
        # A connection that showed a valid token is out of the count.
        request = (
            b"GET /v1/apps HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\n\r\n"
        )
        kept.sendall(request)
        assert read_response(kept).startswith(b"HTTP/1.1 200 ")
        idle = [connect(capped) for _ in range(8)]
        try:
            # Wait until the server has taken all eight: one more answered request proves it.
            assert httpx.get(f"{capped.url}/healthz").status_code == 200
            newer = [connect(capped) for _ in range(4)]
            try:
                for sock in idle[:4]:
                    assert read_until_closed(sock) == b""
                assert httpx.get(f"{capped.url}/healthz").status_code == 200
                kept.sendall(request)
                assert read_response(kept).startswith(b"HTTP/1.1 200 ")
            finally:
                for sock in newer:
                    sock.close()
        finally:
            for sock in idle:
                sock.close()
