"""``heteroplane app down NAME`` against a tiny fake service (``http.server`` on 127.0.0.1) whose
answers move on with each request: the teardown is asked for with ``?drain=true``, the fleet is
polled until the app is a 404, with a progress line each time it changes; an app without
instances is deleted at once; ``--no-wait`` returns at once; a teardown that does not finish in
``--wait-s`` is one line and exit status 2. Nothing asserts on time."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controlplane.cli import main

TOKEN = "hp_admin-token"
INSTANCES = [
    {"id": f"i-{n}", "app": "shop", "request_id": f"r-{n}", "provider_id": f"p-{n}",
     "instance_type": "c5.xlarge", "state": "running", "price_usd_per_hr": 0.17,
     "created_at": "2024-01-01T00:00:00Z", "updated_at": "2024-01-01T00:00:00Z"}
    for n in (1, 2, 3)
]  # fmt: skip
TEARDOWN = {
    "app": "shop",
    "status": "draining",
    "instances": INSTANCES,
    "message": "app shop: draining 3 instance(s) at once; the app is deleted when none is left",
}


def fleet(states: dict[str, int]) -> dict[str, Any]:
    count = sum(states.values())
    return {
        "app": "shop",
        "budget_usd_per_hr": 1.0,
        "cost_usd_per_hr": 0.17 * count,
        "instances": count,
        "by_type": [
            {
                "instance_type": "c5.xlarge",
                "count": count,
                "price_usd_per_hr": 0.17,
                "cost_usd_per_hr": 0.17 * count,
                "states": states,
            }
        ],
    }


NOT_FOUND = (404, {"error": {"code": "not_found", "message": "no app 'shop'", "field": None}})


class FakeService:
    """Answers ``DELETE`` from :attr:`delete_answer` and each ``GET .../fleet`` from the next of
    :attr:`fleets` (the last one again once they run out); keeps every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.delete_answer: tuple[int, Any] = (202, TEARDOWN)
        self.fleets: list[tuple[int, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_DELETE(self) -> None:
                service.requests.append(("DELETE", self.path))
                self._send(*service.delete_answer)

            def do_GET(self) -> None:
                service.requests.append(("GET", self.path))
                answer = service.fleets.pop(0) if len(service.fleets) > 1 else service.fleets[0]
                self._send(*answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeService]:
    service = FakeService()
    monkeypatch.setenv("HETEROPLANE_URL", service.url)
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    yield service
    service.close()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_app_down_waits_for_the_app_to_be_gone_with_progress(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fleets = [
        (200, fleet({"terminating": 3})),
        (200, fleet({"terminating": 3})),
        (200, fleet({"terminating": 1})),
        NOT_FOUND,
    ]
    status, out, err = cli(capsys, "app", "down", "shop", "--poll-s", "0.01")
    assert status == 0
    assert out.strip() == "app shop: 3 instance(s) drained; the app is deleted"
    assert err.splitlines() == [
        TEARDOWN["message"],
        "app shop: 3 instance(s) left: 3 terminating",
        "app shop: 1 instance(s) left: 1 terminating",
    ]
    assert fake.requests[0] == ("DELETE", "/v1/apps/shop?drain=true")
    assert fake.requests[1:] == [("GET", "/v1/apps/shop/fleet")] * 4


def test_app_down_json_is_one_object(fake: FakeService, capsys: pytest.CaptureFixture[str]) -> None:
    fake.fleets = [NOT_FOUND]
    status, out, _ = cli(capsys, "app", "down", "shop", "--json", "--poll-s", "0.01")
    assert status == 0
    assert json.loads(out) == {"app": "shop", "deleted": True, "drained": 3}


def test_app_down_of_an_app_without_instances_is_a_delete(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.delete_answer = (204, None)
    status, out, _ = cli(capsys, "app", "down", "shop")
    assert (status, out.strip()) == (0, "app shop had no live instance: deleted")
    assert fake.requests == [("DELETE", "/v1/apps/shop?drain=true")]


def test_app_down_no_wait_returns_once_asked(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, "app", "down", "shop", "--no-wait")
    assert (status, out.strip()) == (0, TEARDOWN["message"])
    assert fake.requests == [("DELETE", "/v1/apps/shop?drain=true")]


def test_app_down_that_does_not_finish_in_time_is_one_line_and_status_2(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.fleets = [(200, fleet({"terminating": 2}))]
    status, out, err = cli(capsys, "app", "down", "shop", "--wait-s", "0.05", "--poll-s", "0.01")
    assert (status, out) == (2, "")
    last = err.splitlines()[-1]
    assert last.startswith("heteroplane app: app shop is still draining after 0.05 s")
    assert "heteroplane fleet --app shop" in last


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (NOT_FOUND, "heteroplane app: no app 'shop' (HTTP 404 not_found)"),
        (
            (403, {"error": {"code": "forbidden", "message": "needs admin", "field": None}}),
            "heteroplane app: needs admin (HTTP 403 forbidden)",
        ),
    ],
)
def test_app_down_refused_is_one_line_and_status_2(
    fake: FakeService,
    capsys: pytest.CaptureFixture[str],
    answer: tuple[int, Any],
    message: str,
) -> None:
    fake.delete_answer = answer
    status, out, err = cli(capsys, "app", "down", "shop")
    assert (status, out, err.strip()) == (2, "", message)


def test_app_down_refuses_a_bad_wait_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = cli(capsys, "app", "down", "shop", "--wait-s", "-1")
    assert status == 2 and "must be a number > 0" in err and "Traceback" not in err
