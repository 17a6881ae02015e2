"""Where the benchmarks find the checkout and the shared data folder.

The shared data (the Kairos latency samples and the other measured inputs) lives outside the
repository: in ``$HETEROPLANE_SHARED`` or, by default, in ``shared/`` beside the checkout. The
functions read the variable when called; the scripts in benchmarks/ call them once, at import
(``SHARED = shared_dir()``), and benchmarks/results calls them when an experiment runs.

A script run as ``python benchmarks/x.py`` has benchmarks/ on ``sys.path`` but not the checkout,
so it imports this module as ``paths``; imported as ``benchmarks.x`` it uses ``benchmarks.paths``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOT", "kairos_samples", "shared_dir"]

ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared data folder: ``$HETEROPLANE_SHARED`` or ``../shared`` beside the checkout."""
    return Path(os.environ.get("HETEROPLANE_SHARED", ROOT.parent / "shared"))


def kairos_samples() -> Path:
    """The measured latency samples of the five Kairos models on the four EC2 types."""
    return shared_dir() / "data" / "kairos_latency_samples.csv.gz"
