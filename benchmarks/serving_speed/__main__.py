"""``python -m benchmarks.serving_speed PART``: see the package's docstring."""

from __future__ import annotations

import benchmarks.serving_speed as package
from benchmarks.parts import run_part

PARTS = {"dispatcher": "dispatcher", "api": "api", "layers": "layers"}

if __name__ == "__main__":
    raise SystemExit(run_part(package.__name__, package.__doc__ or "", PARTS))
