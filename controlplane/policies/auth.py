"""API tokens and scopes: what a token may do, how tokens are made, and how they are stored.

Scopes (a token has exactly one):

- ``admin``: everything, including tokens and budgets of every app;
- ``operator``: everything a viewer may, plus changing apps: register, plan, apply, budgets;
- ``viewer``: read-only: apps, plans, fleets, decisions, metrics, the dashboard;
- ``infer``: only the inference route (a client that sends queries, nothing else).

``admin`` includes ``operator`` includes ``viewer``; ``infer`` stands apart, and only ``admin``
includes it (so an admin can try the inference route too).

A token is ``hp_`` followed by 32 random bytes in URL-safe base64 (``secrets.token_urlsafe``); the
prefix makes a leaked token easy to recognise (secret scanners key on such prefixes). Only its
SHA-256 is stored: the token is shown once, when made. A token has 256 bits of entropy, so a fast
unsalted hash is enough (a slow password hash protects guessable secrets, which these are not).

>>> scope_allows("operator", "viewer"), scope_allows("viewer", "operator")
(True, False)
>>> scope_allows("infer", "viewer"), scope_allows("admin", "infer")
(False, True)
>>> hash_token("hp_example")[:16]
'3c1f2c780964d289'
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from enum import StrEnum
from types import MappingProxyType

from controlplane.errors import UnknownScopeError

__all__ = [
    "TOKEN_PREFIX",
    "Scope",
    "generate_token",
    "hash_token",
    "hashes_match",
    "looks_like_token",
    "parse_scope",
    "scope_allows",
]

TOKEN_PREFIX = "hp_"
_TOKEN_BYTES = 32


class Scope(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    INFER = "infer"


# granted scope -> every scope it satisfies (itself included).
_INCLUDES: MappingProxyType[Scope, frozenset[Scope]] = MappingProxyType(
    {
        Scope.ADMIN: frozenset(Scope),
        Scope.OPERATOR: frozenset({Scope.OPERATOR, Scope.VIEWER}),
        Scope.VIEWER: frozenset({Scope.VIEWER}),
        Scope.INFER: frozenset({Scope.INFER}),
    }
)


def parse_scope(scope: str) -> Scope:
    """``scope`` as a :class:`Scope`; :class:`UnknownScopeError` naming the known ones otherwise."""
    try:
        return Scope(scope)
    except ValueError:
        raise UnknownScopeError(scope, [s.value for s in Scope]) from None


@functools.lru_cache(maxsize=64)  # a few scopes, asked on every request
def scope_allows(granted: str, required: str) -> bool:
    """Whether a token of scope ``granted`` may do what needs ``required`` (unknown: never)."""
    try:
        return Scope(required) in _INCLUDES[Scope(granted)]
    except ValueError:
        return False


def generate_token() -> str:
    """A new random token: ``hp_`` and 43 URL-safe characters (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)


def looks_like_token(text: str) -> bool:
    """Whether ``text`` has the shape of one of our tokens (a cheap check before a lookup)."""
    return text.startswith(TOKEN_PREFIX) and len(text) > len(TOKEN_PREFIX)


def hash_token(token: str) -> str:
    """The SHA-256 of ``token`` as 64 lowercase hex digits: what the database stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def hashes_match(token: str, stored_hash: str) -> bool:
    """Whether ``token`` hashes to ``stored_hash``, compared in constant time."""
    return hmac.compare_digest(hash_token(token), stored_hash)
