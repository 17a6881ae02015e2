"""Oversized request heads against ``heteroplane serve`` on a loopback port: 431 Request Header
Fields Too Large with the API's error body, whether the app's middleware answers (a head over
32 KiB) or the HTTP protocol does (a head over the 64 KiB it reads), never a connection reset; and
the server goes on serving.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from controlplane.api.limits import MAX_HEAD_READ_BYTES, MAX_HEADER_BYTES
from tests.integration.test_serve import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("headers")
    data_dir = folder / "data"
    data_dir.mkdir()
    running = Server(data_dir, folder / "serve.log")
    try:
        yield running
    finally:
        running.stop()


def assert_431(response: httpx.Response) -> None:
    assert response.status_code == 431, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert json.loads(response.content)["error"]["code"] == "headers_too_large"


def test_a_head_within_the_limit_is_served(server: Server) -> None:
    response = httpx.get(
        f"{server.url}/healthz", headers={"X-Padding": "x" * (MAX_HEADER_BYTES // 2)}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    "size",
    [MAX_HEADER_BYTES + 1_000, 200_000, MAX_HEAD_READ_BYTES + 1_000, 4 * MAX_HEAD_READ_BYTES],
    ids=["just-over", "200KB", "over-the-read-limit", "4MiB"],
)
def test_an_oversized_head_is_a_431(server: Server, size: int) -> None:
    assert_431(httpx.get(f"{server.url}/healthz", headers={"X-Padding": "x" * size}))
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_many_small_fields_count_together(server: Server) -> None:
    headers = {f"X-Field-{i}": "x" * 100 for i in range(2 * MAX_HEADER_BYTES // 100)}
    assert_431(httpx.get(f"{server.url}/healthz", headers=headers))


def test_a_raw_client_that_keeps_sending_reads_the_431(server: Server) -> None:
    """The head past the read limit, sent in one go over a raw socket: the answer arrives
    whole, and the connection ends with an orderly close, not a reset."""
    head = (
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: "
        + b"x" * (2 * MAX_HEAD_READ_BYTES)
        + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large"
    body = rest.partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["code"] == "headers_too_large"
