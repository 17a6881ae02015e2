"""The inference request's fast path: ``POST /v1/apps/{app}/infer`` answered without FastAPI's
per-request machinery when nothing about the request is unusual.

A query through FastAPI passes a dozen ASGI layers, its token is checked in the thread pool (a
hop to another thread and back), its body is validated by pydantic and its answer serialised
by it: on the 2-core machine this was most of the service's CPU per query (docs/serving.md,
"Through the API"). :class:`FastInferMiddleware` sits outermost among the app's middleware and
answers the common case itself, with the same contract:

- the request is ``POST /v1/apps/{app}/infer`` with a valid app name, JSON content, headers and
  a body within the limits, a bearer token that the store verified within the last second
  (:meth:`~controlplane.db.store.Store.cached_token`, kept fresh in the background by
  :class:`TokenCheck`: no request waits for the database while its token is in use) and whose
  scope allows ``infer``, and a body of plain ``inputs`` (and optionally ``sample_ids``) that
  parse as the route's schema would accept them;
- then it stamps the receipt, checks the inputs against the app's model
  (:func:`~controlplane.api.routes.infer.check_inputs`), hands them to the serving loop and
  answers the same JSON document the route does
  (:func:`~controlplane.api.routes.infer.answer_document`), counting the answer
  like :class:`~controlplane.api.counters.RequestCountingMiddleware`; a service error becomes
  the same error answer the app's handlers give it (:func:`~controlplane.api.errors.render_error`).

**The Open Inference Protocol's** ``POST /v2/models/{app}/infer`` (JSON, or Triton's binary
tensors) takes the same way past FastAPI: the same token check, the body read under the model's
limit (:func:`~controlplane.api.routes.oip.body_limit`), checked
(:func:`~controlplane.api.routes.oip.parse_query`) and served
(:func:`~controlplane.api.routes.oip.serve_parsed`) by the route's own functions, its
answer the route's (:func:`~controlplane.api.routes.oip.answer_payload`), a failure of the
serving answered as the route answers it, in the protocol's shape
(:func:`~controlplane.api.routes.oip.error_answer`). A body over the limit, one that is not a
JSON object, a query the protocol refuses, a compressed body or a versioned path go to the
route, which answers them as it always did. At 2,000 q/s the route's layers (FastAPI's
dependencies, the token check in the thread pool) were most of ``/v2``'s CPU per query
(``python -m benchmarks.serving_speed api``; docs/serving.md, "Through the API").

**Admission's refusal** (429 ``overloaded``, :class:`~controlplane.errors.OverloadedError`) comes
as early as it can be told (:meth:`~controlplane.serving.loop.ServingLoop.refuse_early`: would
a query of one sample be refused now? Then this one is, whatever its size), before its body is
read and decoded, on either route (judged under the gear's candidates; for an app that gets
model-less queries, INFaaS ``requirements`` that admission judges at their variant's queues, a
query one of the variants would admit is let through and, once its ``/v1`` body is read and
shows no ``requirements``, judged again under the gears alone before it is parsed; docs/
serving.md, "Admission control"). It is
written here directly (:func:`send_overloaded`), the body and headers the route's handler gives
it in either shape, without building a request object, a response and, on ``/v2``, the API's
body decoded again into the protocol's: past saturation most answers are refusals, and each
one's CPU is taken from the queries that are served (a refused ``/v2`` query had cost about 1.6
times an answered one in process; ``python -m benchmarks.serving_speed layers`` measures both).

Anything else (no or unknown token, another scope, a body the fast checks do not accept, INFaaS
``requirements``, a body or headers over a limit) goes to FastAPI unchanged, with the body read
so far handed on: the route then answers exactly as it always did, errors included. The fast
path never answers an error the route would not, with one exception: a query refused before
its body is read is refused (429) whatever its body holds, where the route would have found a
malformed one, or requirements no variant meets, first (400, 413 or 422): a service past
saturation does not read what it refuses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.counters import RequestCounter
from controlplane.api.errors import error_document, render_error
from controlplane.api.front_door import FrontDoor
from controlplane.api.limits import MAX_BODY_BYTES, MAX_HEADER_BYTES, mark_authenticated
from controlplane.api.routes import APP_NAME_MAX, APP_NAME_PATTERN
from controlplane.api.routes.infer import (
    RECEIVED_S,
    REQUEST_ID_HEADER,
    answer_document,
    check_inputs,
    stamp_receipt,
)
from controlplane.api.routes.oip import (
    HEADER_LENGTH,
    answer_payload,
    body_limit,
    check_binary_switches,
    error_answer,
    parse_query,
    serve_parsed,
    signature_of,
    split_body,
)
from controlplane.api.schemas import MAX_INFER_SAMPLES
from controlplane.errors import OverloadedError
from controlplane.policies.auth import Scope as TokenScope
from controlplane.policies.auth import scope_allows
from provisioners.worker.oip import OipError

_REQUEST_ID = REQUEST_ID_HEADER.encode("latin-1")

__all__ = [
    "MAX_PENDING_CHECKS",
    "FastInferMiddleware",
    "TokenCheck",
    "plain_body",
    "read_up_to",
    "replay",
    "send_ok",
]

logger = logging.getLogger(__name__)

# The path of the route, its app name as the route's (controlplane.api.routes.AppName).
_PATH = re.compile(f"/v1/apps/({APP_NAME_PATTERN})/infer")
# The Open Inference Protocol's inference route (unversioned).
_OIP_PATH = re.compile(f"/v2/models/({APP_NAME_PATTERN})/infer")
_HEADER_LENGTH = HEADER_LENGTH.lower().encode("latin-1")
_SAMPLE_ID_MAX = 2**31 - 1
# Tokens with no cached answer checked at once at most; past it, such a request goes the
# route's way (a flood of made-up tokens must not queue up in the serving loop's thread pool).
MAX_PENDING_CHECKS = 64


def plain_body(document: Any) -> tuple[list[list[float]], list[int] | None] | None:
    """``inputs`` and ``sample_ids`` of a request body the route's schema
    (:class:`~controlplane.api.schemas.InferIn`) accepts as it stands, or None where the route
    must judge: any other key, an empty or over-long ``inputs``, a sample that is not a
    non-empty list of finite numbers (bool is not a number), ``sample_ids`` that are not one
    whole number in 0..2^31-1 per input.

    >>> plain_body({"inputs": [[1, 2.5]], "sample_ids": [3]})
    ([[1, 2.5]], [3])
    >>> plain_body({"inputs": [[True]]}) is None, plain_body({"inputs": [], "x": 1}) is None
    (True, True)
    """
    if type(document) is not dict:
        return None
    inputs = document.get("inputs")
    sample_ids = document.get("sample_ids")
    if len(document) != 1 + ("sample_ids" in document) or type(inputs) is not list:
        return None
    if not 1 <= len(inputs) <= MAX_INFER_SAMPLES:
        return None
    for row in inputs:
        if type(row) is not list or not row:
            return None
        for value in row:
            kind = type(value)
            if kind is float:
                if not math.isfinite(value):
                    return None
            elif kind is not int:
                return None
    if sample_ids is None:
        return inputs, None
    if type(sample_ids) is not list or len(sample_ids) != len(inputs):
        return None
    if any(type(i) is not int or not 0 <= i <= _SAMPLE_ID_MAX for i in sample_ids):
        return None
    return inputs, sample_ids


class TokenCheck:
    """The fast path's token check: the store's cached answer
    (:meth:`~controlplane.db.store.Store.cached_token`), verified again in a thread before it
    ages out, so that a token in use stays cached and no request waits for the database; a
    token with no cached answer is verified once however many requests carry it meanwhile
    (they all wait for that one read, then take what it left in the cache: nothing, if a
    revocation came while it read). None (the route decides) when the store says no or cannot
    answer, and for a token with no cached answer while :data:`MAX_PENDING_CHECKS` others are
    being checked (a flood of unknown tokens goes the route's way, not into this thread pool).

    Without this, the cached answer of a busy client's token expired every ``TOKEN_CACHE_S``
    and every request until the route's check had read the database again took the route's
    path, each with its own database read: at 2,000 q/s a burst of tens of them each second
    held the serving path up for tens of milliseconds."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._pending: dict[str, asyncio.Future[Any]] = {}

    async def principal(self, token: str) -> Any:
        principal, due = self.store.cached_token(token)
        if not due:
            return principal
        if principal is not None:
            self._verify(token)  # still valid: the new answer comes in the background
            return principal
        if token not in self._pending and len(self._pending) >= MAX_PENDING_CHECKS:
            return None
        try:
            await asyncio.shield(self._verify(token))
        except Exception:  # the route reads the store again and answers its error
            return None
        # What the check cached, not what it read: a revocation while it read left nothing.
        return self.store.cached_principal(token)

    def _verify(self, token: str) -> asyncio.Future[Any]:
        pending = self._pending.get(token)
        if pending is None:
            pending = asyncio.ensure_future(
                asyncio.to_thread(self.store.verify_token, token, fresh=True)
            )
            self._pending[token] = pending
            pending.add_done_callback(lambda done: self._settled(token, done))
        return pending

    def _settled(self, token: str, done: asyncio.Future[Any]) -> None:
        self._pending.pop(token, None)
        if not done.cancelled() and done.exception() is not None:
            logger.debug("token check failed in the background: %s", done.exception())


# A /v1 body that holds this key may be a model-less query (INFaaS ``requirements``).
_REQUIREMENTS = b'"requirements"'


class FastInferMiddleware:
    """Answer the common ``POST /v1/apps/{app}/infer`` outside FastAPI (module docstring).

    ``services`` is the app's :class:`~controlplane.api.deps.Services` (its store, serving loop
    and request counter); ``clock_s`` the serving loop's clock, which stamps the receipt, or,
    with ``head_stamps``, the protocol's stamp (:func:`~controlplane.api.routes.infer.
    stamp_receipt`)."""

    def __init__(
        self,
        app: ASGIApp,
        services: Any,
        clock_s: Callable[[], float],
        max_body_bytes: int = MAX_BODY_BYTES,
        max_header_bytes: int = MAX_HEADER_BYTES,
        head_stamps: bool = False,
    ) -> None:
        self.app = app
        self.services = services
        self.clock_s = clock_s
        self.head_stamps = head_stamps
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.counter: RequestCounter = services.requests
        self.front_door: FrontDoor | None = services.front_door
        self.tokens = TokenCheck(services.store)

    def _count(self, app: str, status: int) -> None:
        """Count the answer to an inference query of ``app``; the front door's throttle
        learns admission's verdict from it (:mod:`controlplane.api.front_door`)."""
        self.counter.add(app, status)
        if self.front_door is not None:
            self.front_door.answered(app, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = _PATH.fullmatch(scope["path"])
        oip = match is None
        if oip:
            match = _OIP_PATH.fullmatch(scope["path"])
        serving = self.services.serving
        if match is None or serving is None or len(match.group(1)) > APP_NAME_MAX:
            await self.app(scope, receive, send)
            return
        stamp_receipt(scope, self.clock_s, self.head_stamps)
        principal = None
        token = ""
        # The route of /v2 reads any content type (Triton's binary bodies are octet-stream)
        # but no compressed body.
        json_content = oip
        header_length = None
        size = 0
        request_id = None
        for name, value in scope["headers"]:
            size += len(name) + len(value) + 4
            if name == b"authorization":
                scheme, _, credentials = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = credentials.strip()
            elif name == b"content-type" and not oip:
                json_content = value.split(b";", 1)[0].strip().lower() == b"application/json"
            elif name == _REQUEST_ID:
                request_id = value.decode("latin-1")
            elif name == _HEADER_LENGTH:
                if header_length is not None:
                    json_content = False  # given twice: the route refuses it
                header_length = value.decode("latin-1")
            elif name == b"content-encoding" and value.strip().lower() != b"identity":
                json_content = False
        if token and json_content and size <= self.max_header_bytes:
            principal = await self.tokens.principal(token)
        if (
            principal is None
            or not json_content
            or size > self.max_header_bytes
            or not scope_allows(principal.scope, TokenScope.INFER)
        ):
            await self.app(scope, receive, send)
            return
        mark_authenticated(scope)
        if oip:
            await self._oip(scope, receive, send, match.group(1), header_length)
            return
        app_name = match.group(1)
        again = await self._refused_early(app_name, scope[RECEIVED_S], send)
        if again is None:
            return
        read_body, more = await read_up_to(receive, self.max_body_bytes)
        if read_body is None:  # the client went away
            return
        body = read_body
        if again and _REQUIREMENTS not in body:
            # Only a model-less variant would have taken it, and it asks for none: refused
            # before its body is parsed and decoded, by the gears alone.
            refused = await self._refused_early(app_name, scope[RECEIVED_S], send, plain=True)
            if refused is None:
                return
        parsed = None
        if not more and len(body) <= self.max_body_bytes:
            try:
                parsed = plain_body(orjson.loads(body))
            except ValueError:
                parsed = None
        if parsed is None:
            await self.app(scope, replay(body, more, receive), send)
            return
        app = match.group(1)
        scope.setdefault("path_params", {})["app"] = app
        try:
            received = scope[RECEIVED_S]
            config = (await serving.dispatcher_for(app, received)).config
            rows = check_inputs(app, config.model_io(config.models[0]), parsed[0])
            result = await serving.infer(
                app, rows, parsed[1], None, received, request_id=request_id
            )
            payload = orjson.dumps(answer_document(result))
        except OverloadedError as error:  # the handlers' answer, written directly
            await send_overloaded(send, error, oip=False)
            self._count(app, 429)
            return
        except Exception as error:  # every failure gets the answer the route's handlers give
            response = render_error(Request(scope), error)
            self._count(app, response.status_code)
            await response(scope, receive, send)
            return
        self._count(app, 200)
        await send_ok(send, payload, [(b"content-type", b"application/json")])

    async def _refused_early(
        self, app: str, received: float, send: Send, oip: bool = False, plain: bool = False
    ) -> bool | None:
        """None where admission refused the query before its body is read (module docstring):
        then its 429 is sent and counted here. Else whether to ask again once the body shows
        no ``requirements`` (``plain``; :meth:`~controlplane.serving.loop.ServingLoop.
        refuse_early`). A ``/v2`` query carries none (``oip``)."""
        try:
            again: bool = self.services.serving.refuse_early(app, received, plain=plain or oip)
        except OverloadedError as error:
            await send_overloaded(send, error, oip=oip)
            self._count(app, 429)
            return None
        return again

    async def _oip(
        self, scope: Scope, receive: Receive, send: Send, app: str, header_length: str | None
    ) -> None:
        """``POST /v2/models/{app}/infer`` past FastAPI (module docstring)."""
        serving = self.services.serving
        received = scope[RECEIVED_S]
        try:
            signature = await signature_of(serving, app, received)
        except Exception:  # no such app, nothing served: the route answers
            await self.app(scope, receive, send)
            return
        if await self._refused_early(app, received, send, oip=True) is None:
            return
        limit = body_limit(signature, self.services.settings.oip_body_max_bytes)
        body, more = await read_up_to(receive, limit)
        if body is None:  # the client went away
            return
        parsed = None
        document = None
        if not more and len(body) <= limit:
            try:
                document, binary = split_body(body, header_length)
                if isinstance(document, Mapping):
                    parsed = parse_query(signature, document, binary)
                    check_binary_switches(document)
            except (OipError, ValueError):
                parsed = None
        if parsed is None or document is None:
            await self.app(scope, replay(body, more, receive), send)
            return
        scope.setdefault("path_params", {})["app"] = app
        try:
            answered = await serve_parsed(serving, app, signature, document, parsed, received)
            payload, headers = answer_payload(app, document, answered)
        except OverloadedError as error:  # the route's answer, written directly
            await send_overloaded(send, error, oip=True)
            self._count(app, 429)
            return
        except Exception as error:  # the answer the route gives it, in the protocol's shape
            response = await error_answer(Request(scope), error)
            self._count(app, response.status_code)
            await response(scope, receive, send)
            return
        self._count(app, 200)
        await send_ok(send, payload, headers)


async def send_ok(
    send: Send, payload: bytes, headers: list[tuple[bytes, bytes]], status: int = 200
) -> None:
    """An answer of ``payload`` with its content ``headers`` (200 unless ``status`` says), as two
    ASGI messages."""
    start = [*headers, (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": payload})


async def send_overloaded(send: Send, error: OverloadedError, oip: bool) -> None:
    """Admission's 429 for ``error`` as the app's handler answers it
    (:func:`~controlplane.api.errors.error_document`: the API's body, or with ``oip`` the Open
    Inference Protocol's; ``Retry-After`` in whole seconds)."""
    payload = orjson.dumps(error_document(oip, "overloaded", str(error)))
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", str(error.retry_after_s).encode()),
    ]
    await send_ok(send, payload, headers, status=429)


async def read_up_to(receive: Receive, limit: int) -> tuple[bytes | None, bool]:
    """The request's body read until its end or past ``limit`` bytes: (what was read, whether
    more is to come); (None, False) when the client went away."""
    chunks = []
    read = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        read += len(chunk)
        more = message.get("more_body", False)
        if read > limit:
            break
    return b"".join(chunks), more


def replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """A ``receive`` that hands on ``body`` (what was read) first, then the rest as it comes."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replayed
