"""API tokens: issued (only their SHA-256 kept), verified (through the token cache),
revoked."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _label,
    _translated,
)
from controlplane.db.store.records import (
    Principal,
    TokenRecord,
    _token_record,
)
from controlplane.db.store.token_cache import TOKEN_CACHE_S
from controlplane.errors import (
    ConflictError,
    InvalidValueError,
    NotFoundError,
)
from controlplane.policies import auth

__all__ = ["LAST_USED_RESOLUTION_S", "TokenStore"]

# A cached answer with less than this left before it expires is due a new verification
# (cached_token): half of its life.
_DUE_AFTER = timedelta(seconds=TOKEN_CACHE_S / 2)

# last_used_at of a token is refreshed at most this often: not a write per request.
LAST_USED_RESOLUTION_S = 60.0


class TokenStore(StoreBase):
    """API tokens (see the module docstring)."""

    # --- tokens --------------------------------------------------------------------------------

    def create_token(
        self, scope: str, name: str | None = None, *, at: datetime | None = None
    ) -> str:
        """Make a token of ``scope`` named ``name`` (default ``<scope>-<random>``); return the
        token itself, which is shown this once (only its SHA-256 is kept).
        :class:`UnknownScopeError` for an unknown scope, :class:`ConflictError` for a name
        taken."""
        token, _ = self.issue_token(scope, name, at=at)
        return token

    @_translated
    def issue_token(
        self, scope: str, name: str | None = None, *, at: datetime | None = None
    ) -> tuple[str, TokenRecord]:
        """:meth:`create_token`, with the stored record (its name, when it was made)."""
        granted = auth.parse_scope(scope)
        label = _label(name, "name") if name is not None else f"{granted}-{secrets.token_hex(4)}"
        if label != label.strip():
            # ' ' or 'ci ' was a token of its own, beside 'ci', that every audit line
            # ('applied by  ') and `token list` showed as blank or as 'ci'.
            raise InvalidValueError(
                "name", f"must not be blank or start or end with a space, got {label!r}"
            )
        token = auth.generate_token()
        try:
            with transaction(self._sessions) as session:
                row = m.ApiToken(
                    name=label,
                    scope=granted.value,
                    token_hash=auth.hash_token(token),
                    created_at=self._now(at),
                    revoked_at=None,
                    last_used_at=None,
                )
                session.add(row)
                session.flush()
                return token, _token_record(row)
        except IntegrityError:
            raise ConflictError(f"a token named {label!r} already exists") from None

    def cached_principal(self, token: str) -> Principal | None:
        """Who ``token`` belongs to when :meth:`verify_token` answered that within the last
        ``TOKEN_CACHE_S`` (no database read: cheap enough for the event loop); None otherwise,
        and then only :meth:`verify_token` can tell. A revocation in this process clears the
        cache at once; one in another process is seen within ``TOKEN_CACHE_S``, as it is by
        :meth:`verify_token`."""
        return self.cached_token(token)[0]

    def cached_token(self, token: str) -> tuple[Principal | None, bool]:
        """:meth:`cached_principal`, and whether a new :meth:`verify_token` with ``fresh`` is
        due: no answer is cached, or the cached one is past half of its ``TOKEN_CACHE_S``. A
        caller that verifies again when it is due (in the background, the cached answer still
        standing meanwhile) keeps a token in use cached without ever trusting an answer older
        than ``TOKEN_CACHE_S``."""
        if not auth.looks_like_token(token):
            return None, False
        now = self._now(None)
        cached = self._token_cache.get(auth.hash_token(token), now)
        if cached is None:
            return None, True
        due = now >= cached.expires_at - _DUE_AFTER
        return cached.principal, due

    @_translated
    def verify_token(
        self, token: str, *, at: datetime | None = None, fresh: bool = False
    ) -> Principal | None:
        """Who ``token`` belongs to, or None when it is unknown or revoked. Looked up by its
        SHA-256 and compared in constant time; ``last_used_at`` is refreshed (at most once a
        minute). An answer of the last ``TOKEN_CACHE_S`` stands unless ``fresh``: then the
        database is read whatever is cached, and a token it no longer knows leaves the cache."""
        if not auth.looks_like_token(token):
            return None
        digest = auth.hash_token(token)
        now = self._now(at)
        cached = None if fresh else self._token_cache.get(digest, now)
        if cached is not None:
            return cached.principal
        generation = self._token_cache.generation()
        try:
            with transaction(self._sessions) as session:
                row = session.scalar(select(m.ApiToken).where(m.ApiToken.token_hash == digest))
                if row is None or not auth.hashes_match(token, row.token_hash) or row.revoked_at:
                    principal = None
                else:
                    last = row.last_used_at
                    if last is None or (now - last).total_seconds() >= LAST_USED_RESOLUTION_S:
                        row.last_used_at = now
                    principal = Principal(row.name, row.scope)
        except (OperationalError, InterfaceError):
            # The database does not answer: a token verified within TOKEN_OUTAGE_S stands (the
            # serving path answers on the fleet it has); any other stays a database error.
            known = self._token_cache.outage(digest, now)
            if known is None:
                raise
            return known
        self._token_cache.put(digest, principal, now, generation)
        return principal

    @_translated
    def revoke_token(self, name: str, *, at: datetime | None = None) -> TokenRecord:
        """Revoke the token named ``name`` (again: no change)."""
        with transaction(self._sessions) as session:
            row = session.scalar(select(m.ApiToken).where(m.ApiToken.name == name))
            if row is None:
                raise NotFoundError("token", name)
            if row.revoked_at is None:
                row.revoked_at = self._now(at)
            session.flush()
            record = _token_record(row)
        # After the commit: an answer cached meanwhile from the old row goes too, and one read
        # before the commit but not cached yet is not cached.
        self._token_cache.revoked()
        return record

    @_translated
    def get_token(self, name: str) -> TokenRecord:
        with transaction(self._sessions) as session:
            row = session.scalar(select(m.ApiToken).where(m.ApiToken.name == name))
            if row is None:
                raise NotFoundError("token", name)
            return _token_record(row)

    @_translated
    def list_tokens(self) -> list[TokenRecord]:
        with transaction(self._sessions) as session:
            rows = session.scalars(
                select(m.ApiToken).order_by(m.ApiToken.created_at, m.ApiToken.id)
            )
            return [_token_record(row) for row in rows]
