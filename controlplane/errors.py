"""The control-plane service's errors: one root class and the precise cases callers tell apart.

The API maps these to HTTP in one place (``NotFoundError`` -> 404, ``ConflictError`` and its
subclasses -> 409, ``InvalidValueError`` and ``UnknownScopeError`` -> 422, ``DatabaseError`` ->
503; ``SettingsError`` never reaches it); the CLI turns any :class:`ControlPlaneError` into a
one-line message and exit status 2. Every message is one line that names what was wrong.
"""

from __future__ import annotations

__all__ = [
    "AppExistsError",
    "ConflictError",
    "ControlPlaneError",
    "DatabaseError",
    "InvalidTransitionError",
    "InvalidValueError",
    "NotFoundError",
    "SettingsError",
    "UnknownScopeError",
]


class ControlPlaneError(Exception):
    """Root of the control plane's errors."""


class SettingsError(ControlPlaneError, ValueError):
    """A setting that is malformed or out of range; ``field`` names it (``port``, ``ec2.region``).

    The message is the one line ``source: field: problem`` (``source`` is the config file or the
    environment variable the value came from, when known).
    """

    def __init__(self, field: str, problem: str, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        parts = [part for part in (source, field, problem) if part]
        super().__init__(": ".join(parts))


class NotFoundError(ControlPlaneError, LookupError):
    """No ``kind`` (``app``, ``plan``, ``instance``, ``token``) with that ``key``."""

    def __init__(self, kind: str, key: object) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"no {kind} {key!r}")


class ConflictError(ControlPlaneError):
    """A write that lost a race or contradicts the current state (another apply won, a stale
    version); the caller may read again and retry."""


class AppExistsError(ConflictError):
    """An app with this ``name`` is already registered."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an app named {name!r} already exists")


class InvalidTransitionError(ConflictError):
    """An instance lifecycle move that the transition table does not allow."""

    def __init__(self, from_state: str, to_state: str) -> None:
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"an instance cannot go from {from_state!r} to {to_state!r}")


class InvalidValueError(ControlPlaneError, ValueError):
    """A value handed to the store that it refuses (a budget <= 0, a NaN latency, a naive time);
    ``field`` names it. The API validates requests first, so this is a caller's bug or a bad
    command-line value."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class UnknownScopeError(ControlPlaneError, ValueError):
    """A token scope that is not one of the known scopes."""

    def __init__(self, scope: str, known: list[str]) -> None:
        self.scope = scope
        self.known = known
        super().__init__(f"unknown scope {scope!r} (known: {', '.join(known)})")


class DatabaseError(ControlPlaneError):
    """The database cannot be reached, is not migrated, or refused a statement; the message says
    which, on one line, with the URL's password hidden."""
