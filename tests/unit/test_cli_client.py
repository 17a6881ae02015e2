"""The operator commands' HTTP client (``controlplane.cli.client``) against a tiny fake service.

The fake is ``http.server`` in a thread on 127.0.0.1, answering each path as :data:`ROUTES` says
and keeping every request it got. What is checked: the request a command sends (method, path,
query, token, JSON body), the answer it prints, and that every way a request fails (an HTTP error
with or without the API's error body, an answer that is not JSON, no answer in time, nothing
listening, no token, a bad URL) is one line on stderr and exit status 2. Nothing asserts on time.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controlplane.cli import main
from controlplane.cli.client import ApiClient
from controlplane.cli.output import UsageError

TOKEN = "hp_operator-token"
# The API's refusal of a budget that buys no instance (controlplane.apps.budget), its head.
_BUYS_NONE = (
    "budget_usd_per_hr: 0.0001 USD/hr buys no instance: the cheapest candidate, r5n.large, costs"
    " 0.149 USD/hr;"
)
# path -> (status, body: JSON-able, bytes, or None for an empty answer, seconds to wait first)
ROUTES: dict[str, tuple[int, Any, float]] = {
    "/v1/instances": (200, [{"id": 1, "app": "demo", "provider_id": "i-1",
                             "instance_type": "c5.xlarge", "state": "running"}], 0.0),
    "/v1/apps/demo/budget": (200, {"app": "demo", "budget_usd_per_hr": 2.5,
                                   "previous_usd_per_hr": 1.0, "fleet_cost_usd_per_hr": 0.2,
                                   "drain": [], "note": ""}, 0.0),
    "/v1/apps/demo/decisions": (200, [], 0.0),
    "/v1/apps/demo/events": (200, [], 0.0),
    "/v1/apps/demo": (204, None, 0.0),
    "/v1/apps/ghost": (404, {"error": {"code": "not_found", "message": "no app 'ghost'"}}, 0.0),
    "/v1/apps/broken": (500, b"<html>Internal Server Error</html>", 0.0),
    "/v1/apps/html": (200, b"<html>hello</html>", 0.0),
    "/v1/apps/slow": (200, {"name": "slow"}, 2.0),
    "/v1/apps/poor/budget": (422, {"error": {"code": "invalid_spec", "field": "budget_usd_per_hr",
                                             "message": _BUYS_NONE + ' send "force": true to set'
                                             " it anyway (everything drains)"}}, 0.0),
}  # fmt: skip


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up waiting (the timeout test): nothing to report


class FakeService:
    """:data:`ROUTES` on 127.0.0.1, with a record of each request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                service.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "authorization": self.headers.get("Authorization"),
                        "content_type": self.headers.get("Content-Type"),
                        "body": json.loads(self.rfile.read(length)) if length else None,
                    }
                )
                status, body, wait_s = ROUTES.get(self.path.split("?")[0], (404, b"", 0.0))
                time.sleep(wait_s)
                if body is None:
                    data = b""
                elif isinstance(body, bytes):
                    data = body
                else:
                    data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def do_PUT(self) -> None:
                self._answer()

            def do_DELETE(self) -> None:
                self._answer()

        self.server = _Server(("127.0.0.1", 0), Handler)
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
    """Run ``heteroplane argv`` in-process; (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_a_get_sends_the_token_and_the_query(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, "fleet", "--json")
    assert status == 0
    assert json.loads(out) == {"instances": ROUTES["/v1/instances"][1]}
    status, out, _ = cli(
        capsys, "events", "--app", "demo", "--since", "2024-05-01T00:00:00+00:00", "--limit", "5"
    )
    assert status == 0 and out.strip() == "no events"
    sent = fake.requests
    assert [r["method"] for r in sent] == ["GET", "GET", "GET"]
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in sent)
    live = "&".join(f"state={s}" for s in ("requested", "pending", "running", "draining"))
    assert sent[0]["path"] == f"/v1/instances?{live}&state=terminating&limit=101"
    # Query values are form-encoded: the '+' of the time zone survives.
    since = "2024-05-01T00%3A00%3A00%2B00%3A00"
    assert sent[1]["path"] == f"/v1/apps/demo/decisions?since={since}&limit=5"


def test_budget_set_force_sends_force(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, _ = cli(
        capsys, "budget", "set", "--app", "demo", "--usd-per-hr", "0.01", "--reason", "stop",
        "--force",
    )  # fmt: skip
    assert status == 0
    assert fake.requests[-1]["body"] == {
        "budget_usd_per_hr": 0.01,
        "reason": "stop",
        "force": True,
    }


def test_a_put_sends_json_and_an_empty_answer_is_fine(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(
        capsys, "budget", "set", "--app", "demo", "--usd-per-hr", "2.5", "--reason", "more load"
    )
    assert status == 0 and out.startswith("demo: budget $2.5/hr (was $1/hr)")
    put = fake.requests[-1]
    assert (put["method"], put["content_type"]) == ("PUT", "application/json")
    assert put["body"] == {"budget_usd_per_hr": 2.5, "reason": "more load"}
    status, out, _ = cli(capsys, "app", "delete", "demo", "--force")
    assert status == 0 and out.strip() == "deleted app demo and its history"
    assert fake.requests[-1]["method"] == "DELETE"
    assert fake.requests[-1]["path"] == "/v1/apps/demo?force=true"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["app", "get", "ghost"], "heteroplane app: no app 'ghost' (HTTP 404 not_found)"),
        (
            ["app", "get", "broken"],
            "heteroplane app: HTTP 500 Internal Server Error (HTTP 500 http_error)",
        ),
        (["app", "get", "html"], "heteroplane app: {url} answered something that is not JSON"),
        (
            ["app", "get", "slow", "--timeout", "0.2"],
            "heteroplane app: the heteroplane API at {url} did not answer within 0.2 s",
        ),
        (
            ["budget", "set", "--app", "demo", "--usd-per-hr", "nan", "--reason", "x"],
            "heteroplane budget set: argument --usd-per-hr: must be a finite number, got 'nan'",
        ),
        (
            ["budget", "set", "--app", "poor", "--usd-per-hr", "0.0001", "--reason", "t"],
            f"heteroplane budget: {_BUYS_NONE} pass --force to set it anyway (everything drains)"
            " (HTTP 422 invalid_spec)",
        ),
    ],
)
def test_a_failed_request_is_one_line_and_status_2(
    fake: FakeService, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = cli(capsys, *argv)
    assert (status, out) == (2, "")
    assert err == message.format(url=fake.url) + "\n"


def test_nothing_listening_no_token_and_a_bad_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETEROPLANE_URL", raising=False)
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        status, _, err = cli(capsys, "fleet", "--url", dead)
    assert status == 2
    assert err == (
        f"heteroplane fleet: cannot reach the heteroplane API at {dead}"
        " (is `heteroplane serve` running?)\n"
    )
    status, _, err = cli(capsys, "fleet", "--url", "ftp://example.org")
    assert status == 2
    assert err == (
        "heteroplane fleet: --url must be an http:// or https:// URL, got 'ftp://example.org'\n"
    )
    # The routes go after the URL: a query string answered "no route GET / (HTTP 404)".
    for url in (f"{dead}?x=1", f"{dead}/#top", f"{dead}?"):
        status, _, err = cli(capsys, "fleet", "--url", url)
        assert status == 2
        assert err == (
            f"heteroplane fleet: --url is the API's base URL, without a '?' or '#' part,"
            f" got {url!r}\n"
        )
    monkeypatch.delenv("HETEROPLANE_TOKEN")
    status, _, err = cli(capsys, "fleet", "--url", dead)
    assert status == 2
    assert err == "heteroplane fleet: no API token: pass --token or set HETEROPLANE_TOKEN\n"


def test_https_to_a_plain_http_service_says_so(
    fake: FakeService, capsys: pytest.CaptureFixture[str]
) -> None:
    """The service answered, in plain HTTP: "cannot reach ... (is heteroplane serve running?)"
    sent the operator to look for a service that was running."""
    https = fake.url.replace("http://", "https://")
    status, out, err = cli(capsys, "fleet", "--url", https)
    assert (status, out) == (2, "")
    assert err == (
        f"heteroplane fleet: the TLS handshake with {https} failed (WRONG_VERSION_NUMBER): it"
        " answers plain HTTP (`heteroplane serve` speaks http://; TLS ends in front of it, at a"
        " load balancer)\n"
    )


@pytest.mark.parametrize("option", ["--token", "--url"])
def test_an_empty_token_or_url_given_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    """``--token "$UNSET"`` was taken for no option at all: the environment's token was sent."""
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    monkeypatch.setenv("HETEROPLANE_URL", "http://127.0.0.1:9")
    status, out, err = cli(capsys, "fleet", option, "")
    assert (status, out, err) == (2, "", f"heteroplane fleet: {option} is empty\n")


@pytest.mark.parametrize("value", ["1e308", "inf", "1e10", "nan", "0"])
@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["app", "list"], "--timeout"),
        (["fleet"], "--timeout"),
        (["profile", "run", "--app", "a"], "--timeout"),
        (["cascade", "evaluate", "--app", "a"], "--timeout"),
        (["plans", "apply", "--app", "a", "--id", "1", "--wait"], "--poll-s"),
        (["plans", "apply", "--app", "a", "--id", "1", "--wait"], "--timeout-s"),
        (["app", "down", "a"], "--poll-s"),
        (["app", "down", "a"], "--wait-s"),
        (["loadgen", "--app", "a", "--trace", "t.csv"], "--timeout-s"),
        (["loadgen", "--app", "a", "--trace", "t.csv"], "--progress-s"),
    ],
)
def test_a_wait_past_a_week_is_one_line_before_any_request(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    option: str,
    value: str,
) -> None:
    """A huge or infinite wait reached socket.settimeout or time.sleep (after the plan was
    applied): OverflowError, a traceback."""
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    monkeypatch.setenv("HETEROPLANE_URL", "http://127.0.0.1:9")
    status, out, err = cli(capsys, *argv, option, value)
    assert (status, out) == (2, "")
    assert err.endswith(
        f": argument {option}: must be a number > 0 and at most 604800 s (a week), got {value}\n"
    )
    assert err.count("\n") == 1


def test_the_client_refuses_a_wait_past_a_week() -> None:
    with pytest.raises(UsageError, match="--timeout must be > 0 and at most 604800 s"):
        ApiClient("http://127.0.0.1:9", TOKEN, 1e308)


@pytest.mark.parametrize("token", ["hp_abc\u2019", "hp_\nX", "hp abc", "\u00fc"])
def test_a_token_no_header_can_carry_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    """A pasted typographic quote or a newline is said to be the token's, before any request
    (it failed inside httpx, a traceback or "cannot reach")."""
    monkeypatch.setenv("HETEROPLANE_TOKEN", token)
    status, out, err = cli(capsys, "fleet", "--url", "http://127.0.0.1:9")
    assert (status, out) == (2, "")
    assert err.startswith("heteroplane fleet: the API token (--token or $HETEROPLANE_TOKEN) holds ")
    assert err.endswith("which no token has: copy it again\n") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.44, "0.4 s"),
        (11.94, "11.9 s"),
        (420.0, "420 s"),
        (1050.0, "17.5 min"),
        (11520.0, "3.2 h"),
    ],
)
def test_a_collapsed_lines_span_reads_as_a_person_reads_it(seconds: float, shown: str) -> None:
    """``events`` wrote a span of 1,050 s as ``1.05e+03 s``."""
    from controlplane.cli.operate import _span

    assert _span(seconds) == shown


def test_a_cascades_tuner_decisions_name_their_stage_and_stay_apart(
    fake: FakeService, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cascade's tuner caps two stages in the same ticks: the lines did not say which model
    each was about, and the two ran together as one line ("120x") with the last stage's detail
    (the medium stage's cap was not seen). Each stage now has its own line, named."""

    def capped(at: str, stage: str, s: float) -> dict[str, Any]:
        reason = f"budget_capped: window 1 s saw 40 qps > planned 26 qps; r_max 40 qps, s {s:g}"
        return {
            "id": 1,
            "at": at,
            "kind": "budget_capped",
            "reason": reason,
            "numbers": {"stage": stage, "instance_type": "emu.cpu.small", "count": 1},
            "count": 60,
            "last_at": "2026-12-06T14:29:18.60Z",
        }

    decisions = [
        capped("2026-12-06T14:28:19.607Z", "medium", 0.068),
        capped("2026-12-06T14:28:19.609Z", "large", 0.0128),
    ]
    monkeypatch.setitem(ROUTES, "/v1/apps/demo/decisions", (200, decisions, 0.0))
    status, out, err = cli(capsys, "events", "--app", "demo")
    assert status == 0, err
    lines = [line for line in out.splitlines() if "budget_capped" in line]
    assert len(lines) == 2, out
    assert "60x over" in lines[0] and "medium: budget_capped: " in lines[0], out
    assert "60x over" in lines[1] and "large: budget_capped: " in lines[1], out
    # One stage's decisions (a single-model app's) read as before.
    monkeypatch.setitem(ROUTES, "/v1/apps/demo/decisions", (200, decisions[:1], 0.0))
    status, out, err = cli(capsys, "events", "--app", "demo")
    assert status == 0 and "medium:" not in out and "budget_capped: window" in out, out
