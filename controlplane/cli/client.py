"""How the operator commands talk to a running service: the REST API over HTTP (a synchronous
``httpx.Client``), and how they print tables.

The server is ``--url``, else ``$HETEROPLANE_URL``, else http://127.0.0.1:8000; the token is
``--token``, else ``$HETEROPLANE_TOKEN``. Every failure is an :class:`ApiClientError` whose
message is one line: the server's own error message for an HTTP error, or "cannot reach the
heteroplane API at URL (is `heteroplane serve` running?)" when nothing answers, or the TLS
handshake's failure for an https:// URL (naming plain HTTP where that answered); the CLI prints
it and exits with status 2.

httpx is imported when the first request is sent, not with this module: the parsers of every
command import the options below, and ``heteroplane --help`` should not pay for an HTTP client
(docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from controlplane.cli.output import UsageError

if TYPE_CHECKING:
    import httpx

__all__ = [
    "APP_NAME_MAX",
    "APP_NAME_PATTERN",
    "DEFAULT_URL",
    "MAX_WAIT_S",
    "TOKEN_ENV",
    "URL_ENV",
    "ApiClient",
    "ApiClientError",
    "add_client_options",
    "app_path",
    "client_from",
    "table",
    "wait_seconds",
]

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "HETEROPLANE_URL"
TOKEN_ENV = "HETEROPLANE_TOKEN"
# Planning a large app can take a while; anything else answers in milliseconds.
DEFAULT_TIMEOUT_S = 300.0
# The longest wait an option may ask for (--timeout, --poll-s, ...): a week, past any request,
# profile run or teardown; more is a typo, and from about 9.2e9 s (int64 nanoseconds) on
# socket.settimeout and time.sleep raise OverflowError.
MAX_WAIT_S = 7 * 86_400.0
# An app's name is a DNS label: controlplane.spec's rule (its _APP_NAME_PATTERN and
# _APP_NAME_MAX), copied since the spec module loads pydantic; parsers.LIBRARY_COPIES names the
# source and tests/unit/test_cli_startup.py checks the copy equals it.
APP_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"
APP_NAME_MAX = 63
_APP_NAME = re.compile(APP_NAME_PATTERN)


class ApiClientError(UsageError):
    """A request that failed: the one-line reason (exit status 2)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def wait_seconds(text: str) -> float:
    """argparse type of a wait in seconds (``--timeout``, ``--poll-s``, ...): a number in
    (0, :data:`MAX_WAIT_S`]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_WAIT_S:  # NaN included
        raise argparse.ArgumentTypeError(
            f"must be a number > 0 and at most {MAX_WAIT_S:.0f} s (a week), got {text}"
        )
    return value


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--token``, ``--timeout`` and ``--json``, for a command that calls the API."""
    parser.add_argument(
        "--url", metavar="URL", help=f"the API's base URL (default: ${URL_ENV} or {DEFAULT_URL})"
    )
    parser.add_argument("--token", metavar="TOKEN", help=f"the API token (default: ${TOKEN_ENV})")
    parser.add_argument(
        "--timeout",
        type=wait_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON answer")


class ApiClient:
    """Requests to one server with one token, over one ``httpx.Client`` (made on the first
    request; :meth:`close`, or a ``with`` block, closes its connections)."""

    def __init__(self, url: str, token: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 (read for its check: a port that is not a number)
        except ValueError as error:  # "Invalid IPv6 URL", "Port out of range 0-65535"
            raise UsageError(f"--url {url!r} is not a URL: {error}") from None
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"--url must be an http:// or https:// URL, got {url!r}")
        if parsed.query or parsed.fragment or url.rstrip("/").endswith(("?", "#")):
            # The routes go after it: "?x=1/v1/apps" answered "no route GET /" (a 404).
            raise UsageError(f"--url is the API's base URL, without a '?' or '#' part, got {url!r}")
        if not 0 < timeout_s <= MAX_WAIT_S:
            raise UsageError(
                f"--timeout must be > 0 and at most {MAX_WAIT_S:.0f} s, got {timeout_s!r}"
            )
        if token and not all("!" <= char <= "~" for char in token):
            # An HTTP header carries visible ASCII only: a pasted typographic quote, a space or
            # a newline would fail as the request is made.
            bad = next(char for char in token if not "!" <= char <= "~")
            raise UsageError(
                f"the API token (--token or ${TOKEN_ENV}) holds {bad!r}, which no token has:"
                " copy it again"
            )
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._http: httpx.Client | None = None

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def get(self, path: str, **query: Any) -> Any:
        return self.request("GET", path, query=query)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body=body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body=body)

    def delete(self, path: str, **query: Any) -> Any:
        return self.request("DELETE", path, query=query)

    def upload(self, path: str, content: IO[bytes], **query: Any) -> Any:
        """POST ``content`` (a file opened for reading bytes, streamed; httpx declares its
        length) as ``application/octet-stream``; the decoded JSON answer."""
        return self.request("POST", path, query=query, content=content)

    def download(self, path: str) -> bytes:
        """GET ``path``'s raw bytes (a model artifact), not JSON."""
        if not self.token:
            raise UsageError(f"no API token: pass --token or set {TOKEN_ENV}")
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/octet-stream"}
        response = self._send("GET", self.url + path, None, headers)
        if not response.is_success:
            raise _http_error(response)
        return response.content

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content: IO[bytes] | None = None,
    ) -> Any:
        """Send one request (a JSON ``body``, or the raw bytes of ``content``); the decoded JSON
        answer (None for an empty one)."""
        if not self.token:
            raise UsageError(f"no API token: pass --token or set {TOKEN_ENV}")
        pairs = [(k, v) for k, v in (query or {}).items() if v is not None]
        url = self.url + path + (f"?{urllib.parse.urlencode(pairs, doseq=True)}" if pairs else "")
        try:
            data = None if body is None else json.dumps(body, allow_nan=False).encode()
        except ValueError:
            raise UsageError("cannot send a number that is not finite (nan or inf)") from None
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        response = self._send(method, url, data if content is None else content, headers)
        if not response.is_success:
            raise _http_error(response)
        raw = response.content
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiClientError(f"{self.url} answered something that is not JSON") from None

    def _send(
        self, method: str, url: str, data: bytes | IO[bytes] | None, headers: dict[str, str]
    ) -> httpx.Response:
        """One exchange with the server; what went wrong on the way is one line."""
        import httpx

        if self._http is None:
            # Redirects are followed, as urllib did for this command line before.
            self._http = httpx.Client(timeout=self.timeout_s, follow_redirects=True)
        try:
            return self._http.request(method, url, content=data, headers=headers)
        except httpx.ConnectTimeout:
            raise ApiClientError(self.unreachable()) from None
        except httpx.TimeoutException:
            raise ApiClientError(
                f"the heteroplane API at {self.url} did not answer within {self.timeout_s:g} s"
            ) from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as error:
            # Refused, reset, a name that does not resolve, a server that hung up; or a TLS
            # handshake that failed, where something did answer (an https:// URL of the
            # service's own plain-HTTP port: "is it running?" sent the operator the wrong way).
            tls = _tls_failure(error)
            if tls is not None:
                plain = tls in _PLAIN_HTTP_ANSWERS
                raise ApiClientError(
                    f"the TLS handshake with {self.url} failed ({tls})"
                    + (
                        ": it answers plain HTTP (`heteroplane serve` speaks http://; TLS ends"
                        " in front of it, at a load balancer)"
                        if plain
                        else ""
                    )
                ) from None
            raise ApiClientError(self.unreachable()) from None
        except httpx.HTTPError as error:  # a proxy, an unsupported protocol, too many redirects
            raise ApiClientError(f"{self.unreachable()}: {error}") from None

    def unreachable(self) -> str:
        return f"cannot reach the heteroplane API at {self.url} (is `heteroplane serve` running?)"


def _http_error(response: httpx.Response) -> ApiClientError:
    status = response.status_code
    try:
        detail = json.loads(response.content or b"{}")["error"]
        if isinstance(detail, str):  # the Open Inference Protocol's {"error": "one line"}
            detail = {"message": detail, "code": "error"}
        message, code = str(detail["message"]), str(detail["code"])
    except (ValueError, KeyError, TypeError):
        message, code = f"HTTP {status} {response.reason_phrase}", "http_error"
    return ApiClientError(f"{message} (HTTP {status} {code})", status, code)


def client_from(args: argparse.Namespace) -> ApiClient:
    """The client the command-line options (and the environment) describe."""
    for option, value in (("--url", args.url), ("--token", args.token)):
        if value is not None and not value.strip():
            # An empty value given (an unset variable in `--token "$TOKEN"`) is not the
            # environment's: it was taken for no option at all.
            raise UsageError(f"{option} is empty")
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    token = args.token or os.environ.get(TOKEN_ENV)
    return ApiClient(url, token, args.timeout)


def app_path(app: str, *parts: str) -> str:
    """``/v1/apps/{app}/...``; a name that is not an app's (a DNS label, as the spec holds
    it to) is refused here, before anything is sent: ``demo/plans`` was sent as
    ``demo%2Fplans``, which an HTTP server may decode before routing, to ``/v1/apps/demo/plans``
    (the list of demo's plans taken for an app). An empty one would name the list of apps."""
    if not app:
        raise UsageError("an app's name must not be empty")
    if _APP_NAME.fullmatch(app) is None or len(app) > APP_NAME_MAX:
        raise UsageError(
            f"app name {app!r} is not a DNS label: 1 to {APP_NAME_MAX} lower-case letters,"
            " digits and '-', starting and ending with a letter or digit"
        )
    quoted = urllib.parse.quote(app, safe="")
    return "/".join([f"/v1/apps/{quoted}", *parts]) if parts else f"/v1/apps/{quoted}"


# OpenSSL's reasons for a TLS client that got a plain-HTTP answer to its hello.
_PLAIN_HTTP_ANSWERS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE"})


def _tls_failure(error: BaseException) -> str | None:
    """The reason of the TLS error behind ``error`` (httpx's, raised from httpcore's, raised
    from :mod:`ssl`'s), or None when none is."""
    import ssl

    seen: BaseException | None = error
    for _ in range(8):  # the chain is short; a cycle is not followed for ever
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return str(getattr(seen, "reason", None) or seen)
        seen = seen.__cause__ or seen.__context__
    return None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: a header line and aligned columns (numbers to the right)."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(headers), *(line(row) for row in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)
