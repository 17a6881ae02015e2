"""Inference requests for an app that another serving process dispatches, forwarded to it
(docs/service.md, "Several serving processes").

:class:`ForwardingMiddleware` sits outermost: a ``POST /v1/apps/{app}/infer`` or ``POST
/v2/models/{app}[/versions/{v}]/infer`` whose app's dispatcher is another serving process
(:meth:`~controlplane.serving.owners.DispatchOwners.forward_to`) is sent there as it came (its
path, query, headers with the token, body), over a pool of kept-alive connections, and the
client gets the dispatcher's answer (status, headers, body) as it is; the dispatcher checks the
token and the input. Everything else passes through unchanged.

- A forwarded request carries ``X-Heteroplane-Forwarded: 1``, and one that carries it is served
  where it lands (never forwarded twice, whatever the two processes believe).
- A dispatcher that cannot be reached (it died and its lease has not ended yet; a connection
  refused or reset, a timeout) is logged once per URL and outage, and the query is served here
  instead: the serving loop matches it alone, as before this forwarding existed.
- A body longer than ``body_max_bytes`` (the ``/v2`` ceiling, ``oip_body_max_bytes``) is not read
  whole here: the request is served here, where the limits answer it.
- gRPC's ModelInfer (:mod:`controlplane.api.grpc_oip`) is forwarded too, as the REST query it
  is (:func:`forward_oip`: its document and raw inputs as ``POST /v2/models/{app}/infer`` with
  the caller's ``authorization``, every output asked for in binary); the gRPC service turns the
  dispatcher's answer back into a ModelInferResponse. The other gRPC methods (health,
  metadata) are answered where they land.
- A forwarded request whose token this process knows as valid (the fast path's cached check,
  :class:`~controlplane.api.fast_infer.TokenCheck`) marks its connection authenticated, as the
  route's check would, so a client's kept-alive connections do not count against
  ``http_unauthenticated_connections_max`` here.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, Protocol

import httpx
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.limits import mark_authenticated
from controlplane.api.routes import APP_NAME_PATTERN
from controlplane.api.routes.oip import HEADER_LENGTH

__all__ = [
    "FORWARDED_HEADER",
    "FORWARD_TIMEOUT_S",
    "Forwarder",
    "ForwardingMiddleware",
    "forward_oip",
]

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-heteroplane-forwarded"
# The longest a forwarded query may take, s: past the serving loop's own limit on a query (30 s).
FORWARD_TIMEOUT_S = 60.0
# Connections kept open to each dispatcher.
_KEEPALIVE = 64
_INFER = re.compile(
    rf"/v1/apps/(?P<v1>{APP_NAME_PATTERN})/infer"
    rf"|/v2/models/(?P<v2>{APP_NAME_PATTERN})(?:/versions/[^/]+)?/infer"
)
# Hop-by-hop headers (RFC 9110 7.6.1) and those the client library sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class Owners(Protocol):
    # This serving process's id among the dispatchers (its /healthz says it, so that a process
    # checks it is the one its advertised URL reaches).
    owner: str

    def forward_to(self, app: str) -> str | None: ...


class Tokens(Protocol):
    async def principal(self, token: str) -> Any: ...


class Forwarder:
    """The pool of connections to the other serving processes, and what to forward where;
    ``tokens`` (when given) tells the tokens this process knows as valid."""

    def __init__(self, owners: Owners, body_max_bytes: int, tokens: Tokens | None = None) -> None:
        self.owners = owners
        self.body_max_bytes = int(body_max_bytes)
        self.tokens = tokens
        self._client: httpx.AsyncClient | None = None
        self._unreachable: set[str] = set()

    def client(self) -> httpx.AsyncClient:
        # Made on the event loop that uses it (the first forwarded request's).
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=FORWARD_TIMEOUT_S,
                limits=httpx.Limits(
                    max_keepalive_connections=_KEEPALIVE, max_connections=4 * _KEEPALIVE
                ),
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def reached(self, url: str) -> None:
        if url in self._unreachable:
            self._unreachable.discard(url)
            logger.info("the dispatcher at %s answers again", url)

    def unreachable(self, url: str, error: Exception) -> None:
        if url not in self._unreachable:
            self._unreachable.add(url)
            logger.warning(
                "the dispatcher at %s does not answer (%s): its apps' queries are served here",
                url,
                type(error).__name__,
            )


async def forward_oip(
    forwarder: Forwarder,
    url: str,
    app: str,
    document: Mapping[str, Any],
    binary: bytes,
    authorization: str | None,
) -> httpx.Response | None:
    """An Open Inference Protocol query for ``app`` (its JSON ``document`` and the raw inputs
    ``binary``, as :func:`controlplane.api.grpc_oip.request_document` makes them from a gRPC
    ModelInfer) sent to the app's dispatcher at ``url`` as ``POST /v2/models/{app}/infer``,
    with ``authorization`` (the caller's, checked there) and every output asked for in binary.
    The dispatcher's answer whatever its status; None when it cannot be reached (logged as
    :class:`ForwardingMiddleware` logs it), and the query is then served here."""
    parameters = dict(document.get("parameters") or {})
    parameters["binary_data_output"] = True
    forwarded = {**document, "parameters": parameters}
    outputs = document.get("outputs")
    if isinstance(outputs, list):
        # gRPC answers every output raw, whatever a client's binary_data on one says (the
        # route would refuse one that is not a boolean): each is asked for in binary here.
        forwarded["outputs"] = [_binary_output(entry) for entry in outputs]
    header = orjson.dumps(forwarded)
    headers = {FORWARDED_HEADER: "1", "content-type": "application/json"}
    if authorization is not None:
        headers["authorization"] = authorization
    if binary:
        headers["content-type"] = "application/octet-stream"
        headers[HEADER_LENGTH] = str(len(header))
    target = f"{url}/v2/models/{urllib.parse.quote(app, safe='')}/infer"
    try:
        answer = await forwarder.client().post(target, content=header + binary, headers=headers)
    except httpx.TransportError as error:
        forwarder.unreachable(url, error)
        return None
    forwarder.reached(url)
    return answer


def _binary_output(entry: Any) -> Any:
    """An ``outputs`` entry of a forwarded gRPC query without its own ``binary_data`` (the
    query's ``binary_data_output`` then asks for it in binary)."""
    settings = entry.get("parameters") if isinstance(entry, Mapping) else None
    if not isinstance(settings, Mapping) or "binary_data" not in settings:
        return entry
    rest = {key: value for key, value in settings.items() if key != "binary_data"}
    return {**entry, "parameters": rest}


def forwarded_app(scope: Scope) -> str | None:
    """The app of an inference request that may be forwarded (see the module docstring)."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    matched = _INFER.fullmatch(scope.get("path", ""))
    if matched is None:
        return None
    if any(name == FORWARDED_HEADER.encode() for name, _ in scope.get("headers", ())):
        return None
    return matched.group("v1") or matched.group("v2")


class ForwardingMiddleware:
    """Forward the inference requests of apps another serving process dispatches (see the module
    docstring)."""

    def __init__(self, app: ASGIApp, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = forwarded_app(scope)
        url = None if app is None else self.forwarder.owners.forward_to(app)
        if url is None:
            await self.app(scope, receive, send)
            return
        await self._mark_authenticated(scope)
        body, more, first = await _read_body(receive, self.forwarder.body_max_bytes)
        if more:
            # Too long to hold here: served here, where the limits answer it.
            await self.app(scope, _replayed(first, receive), send)
            return
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope.get("headers", ())
            if name.decode("latin-1").lower() not in _HOP
        ]
        headers.append((FORWARDED_HEADER, "1"))
        query = scope.get("query_string", b"").decode("latin-1")
        target = f"{url}{scope.get('raw_path', b'').decode('latin-1') or scope['path']}"
        if query and "?" not in target:
            target = f"{target}?{query}"
        try:
            answer = await self.forwarder.client().post(target, content=body, headers=headers)
        except httpx.TransportError as error:
            self.forwarder.unreachable(url, error)
            await self.app(scope, _replayed([_chunk(body)], receive), send)
            return
        self.forwarder.reached(url)
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [
                    (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in answer.headers.multi_items()
                    if name.lower() not in _HOP and name.lower() != "content-encoding"
                ]
                + [(b"content-length", str(len(answer.content)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer.content})

    async def _mark_authenticated(self, scope: Scope) -> None:
        tokens = self.forwarder.tokens
        if tokens is None:
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and token and await tokens.principal(token.strip()):
            mark_authenticated(scope)


def _chunk(body: bytes) -> Message:
    return {"type": "http.request", "body": body, "more_body": False}


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool, list[Message]]:
    """The request's body when it is at most ``limit`` bytes; else what was read (as the
    messages received) and True."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return b"", True, messages  # the client went: let the app see it
        size += len(message.get("body", b""))
        if size > limit:
            return b"", True, messages
        if not message.get("more_body", False):
            return b"".join(m.get("body", b"") for m in messages), False, messages


def _replayed(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` with ``messages`` first (a body read here, handed on to the app)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
