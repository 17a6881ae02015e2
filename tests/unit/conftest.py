"""Fixtures shared by the unit tests: the demo model family, trained once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the trained demo family and its validation records, made by the
    same function ``load_model`` and ``heteroplane cascade evaluate`` call (about 15 s, once)."""
    from provisioners.worker.family import ensure_family

    return ensure_family(tmp_path_factory.mktemp("family") / "models")
