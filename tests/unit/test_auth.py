"""Scopes and tokens: what each scope allows, the token format, the hash."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from controlplane.errors import UnknownScopeError
from controlplane.policies.auth import (
    TOKEN_PREFIX,
    Scope,
    generate_token,
    hash_token,
    hashes_match,
    looks_like_token,
    parse_scope,
    scope_allows,
)

EXPECTED = {
    "admin": {"admin", "operator", "viewer", "infer"},
    "operator": {"operator", "viewer"},
    "viewer": {"viewer"},
    "infer": {"infer"},
}


@pytest.mark.parametrize(("granted", "required"), list(itertools.product(EXPECTED, EXPECTED)))
def test_scope_allows(granted: str, required: str) -> None:
    assert scope_allows(granted, required) == (required in EXPECTED[granted])


def test_scopes_nest_and_infer_stands_apart() -> None:
    chain = ["viewer", "operator", "admin"]
    for lower, higher in itertools.pairwise(chain):
        assert scope_allows(higher, lower) and not scope_allows(lower, higher)
    for scope in ("viewer", "operator"):
        assert not scope_allows("infer", scope) and not scope_allows(scope, "infer")


def test_unknown_scopes_allow_nothing() -> None:
    assert not scope_allows("root", "viewer")
    assert not scope_allows("admin", "root")


def test_parse_scope() -> None:
    assert parse_scope("operator") is Scope.OPERATOR
    with pytest.raises(UnknownScopeError, match="unknown scope 'root' \\(known: admin, operator"):
        parse_scope("root")


def test_tokens_are_prefixed_random_and_url_safe() -> None:
    tokens = {generate_token() for _ in range(100)}
    assert len(tokens) == 100
    for token in tokens:
        assert token.startswith(TOKEN_PREFIX)
        body = token.removeprefix(TOKEN_PREFIX)
        assert len(body) == 43  # 32 bytes in unpadded base64
        assert set(body) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        assert looks_like_token(token)


def test_looks_like_token() -> None:
    assert not looks_like_token("")
    assert not looks_like_token("hp_")
    assert not looks_like_token("Bearer hp_x")


def test_hash_is_sha256_hex() -> None:
    token = generate_token()
    assert hash_token(token) == hashlib.sha256(token.encode()).hexdigest()
    assert len(hash_token(token)) == 64
    assert hashes_match(token, hash_token(token))
    assert not hashes_match(token + "x", hash_token(token))
