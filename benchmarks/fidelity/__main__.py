"""``python -m benchmarks.fidelity PART``: see the package's docstring."""

from __future__ import annotations

import benchmarks.fidelity as package
from benchmarks.parts import run_part

PARTS = {"serving": "serving", "demo": "demo", "cycle": "cycle"}

if __name__ == "__main__":
    raise SystemExit(run_part(package.__name__, package.__doc__ or "", PARTS))
