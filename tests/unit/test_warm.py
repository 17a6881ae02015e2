"""``python -m estimator.warm`` reaches every cached kernel of the estimator and the matching
library, and leaves each in numba's cache.

The warm-up runs in a process of its own, where nothing else has called a kernel: a kernel it
calls from Python has signatures there afterwards (compiled, or loaded from the cache that a
checkout which ran it before already holds: well under a second then), and a kernel that only
other kernels call is reached when one that it reached calls it by name (compiled into its
caller's code, which the cache holds). So a warm-up that misses a kernel fails this test
whatever the state of the cache.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from numba.core.registry import CPUDispatcher

import estimator
import matching

ROOT = Path(__file__).resolve().parents[2]


def cached_kernels() -> dict[str, Any]:
    """Every compiled kernel of the two libraries that numba caches on disk, by name."""
    found = {}
    for package in (estimator, matching):
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if (
                    isinstance(value, CPUDispatcher)
                    and value.py_func.__module__ == module.__name__
                    and type(getattr(value, "_cache", None)).__name__ == "FunctionCache"
                ):
                    found[f"{module.__name__}.{value.py_func.__name__}"] = value
    return found


def index_path(kernel: Any) -> Path:
    """Where numba looks for ``kernel``'s index of compiled signatures."""
    return Path(kernel._cache._cache_file._index_path)


def after_the_warm_up() -> dict[str, Any]:
    """Run the warm-up here, then say of each cached kernel whether it was called from Python
    (it has signatures), the names it calls, whether it is inlined into its callers and whether
    numba's cache holds an index for it."""
    from estimator import warm

    kernels = cached_kernels()
    warm.warm()
    return {
        name: {
            "called": bool(kernel.signatures),
            "source": inspect.getsource(kernel.py_func),
            "short": kernel.py_func.__name__,
            "inlined": kernel.targetoptions.get("inline") == "always",
            "indexed": index_path(kernel).is_file(),
        }
        for name, kernel in kernels.items()
    }


def test_the_warm_up_reaches_every_cached_kernel_and_caches_it() -> None:
    script = "import json, tests.unit.test_warm as t; print(json.dumps(t.after_the_warm_up()))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = json.loads(done.stdout.splitlines()[-1])
    # The libraries' kernels at the time of writing: the search must find them.
    assert {"matching.kairos.round_flow_kernel", "estimator.envelope._max_arrivals_py"} <= set(
        kernels
    )
    reached = {name for name, k in kernels.items() if k["called"]}
    grown = True
    while grown:  # a kernel a reached kernel calls by name is reached
        calls = " ".join(kernels[name]["source"] for name in reached)
        more = {n for n, k in kernels.items() if n not in reached and f"{k['short']}(" in calls}
        reached |= more
        grown = bool(more)
    assert set(kernels) == reached, f"not reached by the warm-up: {set(kernels) - reached}"
    uncached = [n for n, k in kernels.items() if not k["inlined"] and not k["indexed"]]
    assert not uncached, f"not in numba's cache after the warm-up: {uncached}"
