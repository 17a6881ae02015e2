"""Errors of the matching library."""

from __future__ import annotations


class MatchingError(ValueError):
    """Root of the matching library's errors."""


class InvalidDispatchError(MatchingError):
    """A policy returned a dispatch the engine cannot carry out (busy instance, unknown query)."""
