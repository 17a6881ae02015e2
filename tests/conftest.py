"""Where the shared measured data lives: ``../shared`` beside the checkout, or
$HETEROPLANE_SHARED."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("HETEROPLANE_SHARED", Path(__file__).resolve().parents[2] / "shared"))
KAIROS_CSV = SHARED / "data" / "kairos_latency_samples.csv.gz"

needs_shared = pytest.mark.skipif(
    not KAIROS_CSV.exists(), reason=f"the shared data is not at {SHARED} (set HETEROPLANE_SHARED)"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (stable otherwise): on two processes (``make test``, a file per
    process) their files then start at once and the rest of the suite runs beside them, rather
    than a minutes-long test starting last and running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
